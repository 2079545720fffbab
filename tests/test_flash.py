"""The flash backend (attention/flash.py): its layout, window and LSE handling through the
reference kernel on any device, and on a GPU with flash-attn-4 or flash-attn 2 the real kernels
against the reference and against PyTorch's kernels."""

import pytest
import torch

from specextend.attention.backends import CAUSAL, FlashBackend, TorchBackend, get_backend
from specextend.attention.flash import FlashKernel, find_kernel, reference_kernel
from specextend.attention.hybrid import layer_attention

GEOMS = [(4, 2, 16), (6, 1, 32), (4, 4, 8)]  # (H, G, D)
CASES = [(0, 9, 0), (13, 7, 0), (40, 1, 0), (30, 6, 8), (5, 6, 16), (0, 12, 4)]  # (L, t, window)


class Counting(FlashKernel):
    def __init__(self):
        super().__init__("reference", reference_kernel)
        self.calls = 0

    def __call__(self, *a):
        self.calls += 1
        return super().__call__(*a)


def rand(h, g, d, L, t, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(g, L + t + 3, d, generator=gen, dtype=torch.float64)  # a cache with spare room
    v = torch.randn(g, L + t + 3, d, generator=gen, dtype=torch.float64)
    return [x.to(device, dtype) for x in (q, k, v)]


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("L,t,window", CASES)
@pytest.mark.parametrize("need_lse", [False, True])
def test_end_causal_through_reference_equals_composition(geom, L, t, window, need_lse):
    """The one-call path (the backend's transposes, the key slice, the window) equals the
    compositions it replaces (prefix + causal block merged by LSE; the explicit window mask)."""
    h, g, d = geom
    q, k, v = rand(h, g, d, L, t, seed=L * 7 + t)
    kernel = Counting()
    fast = FlashBackend(kernel, min_rows=1)
    out, lse = layer_attention(fast, q, k, v, L, CAUSAL, 0.3, need_lse=need_lse, window=window)
    ref, ref_lse = layer_attention(TorchBackend(), q, k, v, L, CAUSAL, 0.3, need_lse=need_lse, window=window)
    assert kernel.calls == 1
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    if need_lse and window == 0:  # the window path never returned an LSE (draft prefill needs none)
        torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_small_calls_and_masks_take_the_fallback():
    q, k, v = rand(4, 2, 16, 30, 4)
    kernel = Counting()
    be = FlashBackend(kernel, min_rows=8)
    layer_attention(be, q, k, v, 30, CAUSAL, 0.3)  # 4 rows < 8
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    layer_attention(be, q, k, v, 30, mask, 0.3)  # a tree: its prefix part too small as well
    assert kernel.calls == 0
    q, k, v = rand(4, 2, 16, 30, 8)
    layer_attention(be, q, k, v, 30, CAUSAL, 0.3)
    assert kernel.calls == 1
    layer_attention(be, q, k, v, 30, torch.ones(8, 8, dtype=torch.bool).tril(), 0.3)
    assert kernel.calls == 2  # a large enough tree's prefix part (no mask) goes to the kernel


def test_auto_without_a_kernel_is_torch_and_flash_says_why():
    if find_kernel() is not None:
        pytest.skip("a FlashAttention kernel is installed here")
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="flash-attn-4"):
        get_backend("flash", "cpu")


needs_kernel = pytest.mark.skipif(find_kernel() is None, reason="needs a GPU with flash-attn-4 or flash-attn 2")


@needs_kernel
@pytest.mark.parametrize("h,g,d", [(14, 2, 64), (32, 8, 128)])  # 0.5B draft, 8B geometry (each compiles)
@pytest.mark.parametrize("L,t,window", [(1000, 256, 0), (3000, 128, 1024), (0, 64, 0)])
def test_real_kernel_matches_reference(h, g, d, L, t, window):
    kernel = find_kernel()
    q, k, v = rand(h, g, d, L, t, torch.bfloat16, "cuda", seed=t)
    k, v = k[:, :L + t], v[:, :L + t]
    for causal in (True, False):
        win = window if causal else 0
        args = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), d ** -0.5, causal, win, True)
        out, lse = kernel(*args)
        ref, ref_lse = reference_kernel(*[a.double() if torch.is_tensor(a) else a for a in args])
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)


@needs_kernel
@pytest.mark.parametrize("L", [0, 2048])
def test_flash_prefill_chunk_matches_torch(L):
    """A 0.5B-geometry prefill chunk (LSE kept, as for the first retrieval) through both backends."""
    q, k, v = rand(14, 2, 64, L, 512, torch.bfloat16, "cuda", seed=L)
    fast = get_backend("flash", "cuda")
    assert fast.takes_end_causal(q, k)
    out, lse = layer_attention(fast, q, k, v, L, CAUSAL, 0.125, need_lse=True)
    ref, ref_lse = layer_attention(TorchBackend(), q, k, v, L, CAUSAL, 0.125, need_lse=True)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-3)


def test_warm_up_runs_each_prefill_variant_once():
    kernel = Counting()
    be = FlashBackend(kernel, min_rows=8)
    assert be.warm_up(4, 2, 16, torch.float64, "cpu", windowed=True) == 4  # window or not, LSE or not
    assert be.warm_up(4, 2, 16, torch.float64, "cpu") == 2
    assert kernel.calls == 6


def test_a_kernel_that_fails_its_warm_up_leaves_the_model_on_pytorchs_kernels():
    def broken(*a):
        raise RuntimeError("no kernel for this GPU")

    be = FlashBackend(FlashKernel("reference", broken), min_rows=8)
    assert be.warm_up(4, 2, 16, torch.float64, "cpu") == 0
    q, k, v = rand(4, 2, 16, 30, 8)
    out, _ = layer_attention(be, q, k, v, 30, CAUSAL, 0.3)  # served by the fallback, no error
    ref, _ = layer_attention(TorchBackend(), q, k, v, 30, CAUSAL, 0.3)
    torch.testing.assert_close(out, ref)
