"""fused_sample.py's kernels against their twin, sampling.search over target_probs (on the CPU in
Triton's interpreter, conftest.py), and sampling.sample_rows' choice between them."""

import math

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend import fused_sample
from specextend.config import SamplingParams
from specextend.sampling import search, target_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _twin(logits, params, u):
    """The PyTorch path in float32 -> (samples [R], each row's float64 CDF [R, V] over its total)."""
    probs = target_probs(logits.float(), params)
    cdf = probs.double().cumsum(-1)
    return search(probs, u), cdf / cdf[:, -1:]


def _check(logits, params, u, block):
    """Equal samples, except where u lands within float32 rounding of a step of the twin's CDF."""
    got = fused_sample.fused_sample(logits.to(DEVICE), params, u.to(DEVICE), block=block).cpu()
    ref, cdf = _twin(logits, params, u)
    assert got.dtype == torch.int64 and got.shape == u.shape
    for r in torch.nonzero(got != ref).flatten().tolist():
        edge = cdf[r, min(int(got[r]), int(ref[r]))]  # the step between the two answers
        assert abs(float(edge) - float(u[r])) < 1e-5, (r, int(got[r]), int(ref[r]), float(u[r]))
    assert (got == ref).float().mean() > 0.9  # (a near-step u is rare: a kernel that is off fails here)
    probs = target_probs(logits.float(), params)
    assert bool((probs.gather(1, got[:, None]) > 0).all())  # never a token the twin gives no chance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,v,block", [(9, 1000, 256), (1, 300, 64), (4, 517, 128), (2, 2048, 4096)])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 7, 1.0), (0.25, 1, 1.0),
                                                     (1.0, 0, 0.9), (0.5, 0, 0.3), (2.0, 7, 0.8)])
def test_fused_sample_equals_its_twin(dtype, rows, v, block, temperature, top_k, top_p):
    """Blocks that do not divide the vocabulary, one block, one row; temperatures, top-k (k = 1:
    greedy through the floor) and top-p; logits spread as a model's (a few large, a long tail)."""
    g = torch.Generator().manual_seed(rows * v + top_k)
    logits = (torch.randn(rows, v, generator=g) * 3).to(dtype)
    params = SamplingParams(8, temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(4 if top_p == 1.0 else 2):  # uniforms over [0, 1): every part of each row's CDF
        _check(logits, params, torch.rand(rows, generator=g, dtype=torch.float64), block)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("top_k", [0, 40])
def test_top_p_keeps_the_sorted_prefix(top_p, top_k):
    """top_p_floor's kept set (the columns at or above it) is target_probs' (a sort and a
    cumulative sum): the fewest most likely columns holding top_p of the mass, over every sign and
    exponent of the logits (the radix key's four bytes), ties included."""
    g = torch.Generator().manual_seed(int(top_p * 1000) + top_k)
    logits = torch.randn(5, 900, generator=g) * torch.tensor([0.01, 1.0, 4.0, 30.0, 300.0])[:, None]
    logits[0, :50] = 2.5  # fifty equal maxima: kept together, or not at all
    params = SamplingParams(8, temperature=0.7, top_k=top_k, top_p=top_p)
    x = logits.to(DEVICE)
    has_floor = top_k > 0
    floor = torch.topk(x, top_k, dim=-1).values[:, -1].float().contiguous() if has_floor else x[:, 0].contiguous()
    stat = torch.empty(5, 8, 2, dtype=torch.float32, device=DEVICE)
    from specextend._triton_sample import block_stats

    block_stats[(5, 8)](x, x.stride(0), floor, stat, 0.7, V=900, NB=8, BLOCK=128, HAS_FLOOR=has_floor)
    got = fused_sample.top_p_floor(x, params, floor, has_floor, stat, 128).cpu()
    kept = target_probs(logits, params) > 0  # [R, V]
    for r in range(5):
        assert got[r] == logits[r][kept[r]].min(), r
    assert int(kept[0, :50].sum()) == 50  # (row 0's ties: all kept, however few top_p needs)


def test_the_ends_of_the_uniform_and_masked_blocks():
    """u = 0 gives column 0 (sampling.search's answer); u just below 1 the last column of nonzero
    weight, not a masked column after it; a block masked whole (-inf) weighs nothing."""
    v, block = 700, 128
    logits = torch.linspace(-2, 2, v).repeat(3, 1)
    logits[:, 600:] = float("-inf")  # the last columns: no chance
    logits[:, 128:256] = float("-inf")  # a whole block
    u = torch.tensor([0.0, 1 - 2 ** -40, 0.3], dtype=torch.float64)
    got = fused_sample.fused_sample(logits.to(DEVICE), SamplingParams(4, temperature=1.0), u.to(DEVICE),
                                    block=block).cpu()
    assert got[0] == 0 and got[1] == 599 and not 128 <= int(got[2]) < 256
    ref, _ = _twin(logits, SamplingParams(4, temperature=1.0), u)
    assert torch.equal(got, ref)


def test_a_temperature_below_float32s_range_is_greedy():
    """0/0 where x is the max is 0, as target_probs has it: the argmax, not NaN."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    u = torch.tensor([0.1, 0.5, 0.99], dtype=torch.float64)
    got = fused_sample.fused_sample(logits.to(DEVICE), SamplingParams(4, temperature=1e-45), u.to(DEVICE), block=128)
    assert torch.equal(got.cpu(), logits.argmax(-1))


def test_fused_samples_follow_the_distribution():
    """Seeded uniforms through the kernels: the counts of 800 samples of one row of 6 columns fit
    softmax(logits / 0.7) (chi-square, 5 degrees of freedom, far below its 0.1% point)."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    n = 800
    u = torch.rand(n, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    got = fused_sample.fused_sample(logits.repeat(n, 1).to(DEVICE), SamplingParams(4, temperature=0.7),
                                    u.to(DEVICE), block=8).cpu()
    p = torch.softmax(logits / 0.7, -1)
    counts = torch.bincount(got, minlength=6).double()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5  # (chi-square 0.999 quantile at 5 dof: 20.52)
    assert not math.isnan(chi2)


def test_sample_rows_takes_the_kernels_only_where_they_apply():
    """On a CUDA tensor the kernels (top-p only where TOP_P_KERNELS); on the CPU or in float64 the
    PyTorch path (supported); lookup runs only where the kernels sample without top-p."""
    cpu = torch.zeros(2, 10)
    assert not fused_sample.supported(cpu, SamplingParams(4, temperature=1.0))
    assert fused_sample.runs_cheaply(SamplingParams(4, temperature=1.0, top_k=3))
    assert not fused_sample.runs_cheaply(SamplingParams(4, temperature=1.0, top_p=0.9))
    if DEVICE == "cuda":
        gpu = cpu.cuda()
        assert fused_sample.supported(gpu, SamplingParams(4, temperature=1.0, top_k=3))
        assert fused_sample.supported(gpu, SamplingParams(4, temperature=1.0, top_p=0.9)) == fused_sample.TOP_P_KERNELS
        assert not fused_sample.supported(gpu.double(), SamplingParams(4, temperature=1.0))
