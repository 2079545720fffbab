"""draft/vocab_topk.py's kernels against expand.top_logprobs' torch path, their twin (on the CPU in
Triton's interpreter, conftest.py)."""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.draft import vocab_topk
from specextend.draft.expand import top_logprobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_twin(logits, w):
    top = torch.topk(logits.float(), w)
    return top.values - torch.logsumexp(logits.float(), -1, keepdim=True), top.indices


def _distinct(rows, v, dtype, seed, top=32):
    """Rows whose `top` largest logits are distinct in any dtype (multiples of 1/4 from 0 at random
    columns) above the rest (uniform in [-20, -10): ties there are possible and harmless)."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.rand(rows, v, generator=g) * 10 - 20
    for r in range(rows):
        cols = torch.randperm(v, generator=g)[:min(top, v)]
        vals[r, cols] = torch.arange(cols.numel()).float() / 4
    return vals.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,v,w,block", [(3, 1000, 8, 256), (1, 300, 1, 64), (5, 2048, 16, 512), (2, 517, 4, 1024)])
def test_vocab_topk_equals_torch(dtype, rows, v, w, block):
    """Blocks that do not divide the vocabulary, one block, one row, w = 1 and MAX_W."""
    logits = _distinct(rows, v, dtype, rows * v + w)
    lp, ids = vocab_topk.vocab_topk(logits, w, block=block)
    ref_lp, ref_ids = _torch_twin(logits, w)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == (rows, w)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(lp.cpu(), ref_lp.cpu(), rtol=0, atol=2e-5)


def test_ties_go_to_the_lowest_id_and_masked_blocks_count_nothing():
    v, block = 700, 128
    logits = torch.full((2, v), float("-inf"))
    logits[0, [650, 20, 300, 140]] = 1.0  # four equal maxima in different blocks
    logits[0, 5] = 0.5
    logits[1] = torch.linspace(-3, 3, v)
    logits[1, 128:256] = float("-inf")  # a whole block masked out
    lp, ids = vocab_topk.vocab_topk(logits.to(DEVICE), 5, block=block)
    assert ids[0].tolist() == [20, 140, 300, 650, 5]
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp.cpu(), ref.gather(1, ids.cpu()), rtol=0, atol=1e-5)
    assert ids[1].tolist() == [699, 698, 697, 696, 695]


def test_top_logprobs_takes_the_kernels_only_where_supported():
    x = torch.randn(4, 100)
    assert not vocab_topk.supported(x, 8)  # the CPU: the torch path
    assert not vocab_topk.supported(x.double(), 8) and not vocab_topk.supported(x, vocab_topk.MAX_W + 1)
    lp, ids = top_logprobs(x, 8)
    ref_lp, ref_ids = _torch_twin(x, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    lp1, ids1 = top_logprobs(x[0], 8)  # one row, 1-D
    assert torch.equal(ids1, ids[0]) and torch.equal(lp1, lp[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels' dispatch is for CUDA tensors")
def test_top_logprobs_on_cuda_uses_the_kernels():
    logits = _distinct(6, 151936, torch.bfloat16, 3)
    assert vocab_topk.supported(logits, 8)
    lp, ids = top_logprobs(logits, 8)
    ref_lp, ref_ids = _torch_twin(logits, 8)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-5)
