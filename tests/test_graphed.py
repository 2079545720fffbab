"""models/graphed.Graphed (capture at a signature's first call, replay after) against calling its
function directly, on the functions the draft replays that way."""

import pytest
import torch

from specextend.draft.expand import top_logprobs
from specextend.draft.chain import chain_pick
from specextend.models.graphed import Graphed

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_top_logprobs_equals_eager_across_signatures(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    top = Graphed(top_logprobs, torch.device("cuda"))
    kept = []
    for i in range(6):  # two signatures interleaved; each result must survive later replays
        rows, w = (8, 8) if i % 2 == 0 else (16, 4)
        logits = torch.randn(rows, 1000, device="cuda", generator=g).to(dtype)
        got = top(logits, w)
        kept.append((got, top_logprobs(logits, w)))
    torch.cuda.synchronize()
    for (lp, ids), (ref_lp, ref_ids) in kept:
        assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    assert len(top.plans) == 2 and top.replays == 6


@cuda
def test_graphed_chain_pick_equals_eager():
    g = torch.Generator(device="cuda").manual_seed(1)
    pick = Graphed(chain_pick, torch.device("cuda"))
    r, w, start = 8, 8, 24
    for _ in range(3):
        score = torch.randn(r, device="cuda", generator=g)
        score[-2:] = float("-inf")  # padding rows
        lp = torch.randn(r, w, device="cuda", generator=g).log_softmax(-1)
        ids = torch.randint(0, 500, (r, w), device="cuda", generator=g)
        pos = torch.arange(100, 100 + r, device="cuda")
        mask = torch.rand(r, start, device="cuda", generator=g) > 0.5
        got = pick(score, lp, ids, pos, mask, start)
        ref = chain_pick(score, lp, ids, pos, mask, start)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert got[-1].shape == (r, start + r) and bool(got[-1][:, start:].diagonal().all())
    assert len(pick.plans) == 1 and pick.replays == 3
