"""Every attention backend against the eager reference; HTA against plain masked and per-branch
causal attention."""

import pytest
import torch

from specextend.attention.backends import CAUSAL, flash_available, get_backend
from specextend.attention.eager import attention_eager
from specextend.attention.hybrid import layer_attention
from specextend.tree import ancestor_mask

BACKENDS = ["eager", "torch"] + (["flash"] if flash_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEOMS = [(4, 2, 16), (4, 4, 8), (6, 1, 32)]  # (H, G, D): GQA, MHA, MQA


def rand_kv(h, g, d, L, t, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(g, L + t + 3, d, generator=gen, dtype=torch.float64)
    v = torch.randn(g, L + t + 3, d, generator=gen, dtype=torch.float64)
    return [x.to(DEVICE, dtype) for x in (q, k, v)]


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(atol=1e-5, rtol=1e-5)


DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [torch.float64])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,t", [(0, 9), (13, 7), (40, 1)])  # prefill, chunked prefill, decode
def test_causal_paths_match_eager(backend, geom, dtype, L, t):
    h, g, d = geom
    q, k, v = rand_kv(h, g, d, L, t, dtype, seed=L + t)
    be, ref = get_backend(backend, DEVICE), get_backend("eager", DEVICE)
    for hybrid in (True, False):
        for need_lse in (True, False):
            out, lse = layer_attention(be, q, k, v, L, CAUSAL, d ** -0.5, hybrid=hybrid, need_lse=need_lse)
            exp, exp_lse = layer_attention(ref, q, k, v, L, CAUSAL, d ** -0.5, hybrid=False, need_lse=True)
            torch.testing.assert_close(out, exp, **tol(dtype))
            if need_lse:
                torch.testing.assert_close(lse.float(), exp_lse.float(), **tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_windowed_prefill_matches_eager(backend, geom, dtype):
    h, g, d = geom
    L, t, w = 20, 11, 8
    q, k, v = rand_kv(h, g, d, L, t, dtype, seed=3)
    out, _ = layer_attention(get_backend(backend, DEVICE), q, k, v, L, CAUSAL, d ** -0.5, window=w)
    pos_q = torch.arange(L, L + t)[:, None]
    pos_k = torch.arange(L + t)[None, :]
    mask = ((pos_k <= pos_q) & (pos_k > pos_q - w)).to(DEVICE)
    exp, _ = attention_eager(q, k[:, :L + t], v[:, :L + t], mask, d ** -0.5)
    torch.testing.assert_close(out, exp, **tol(dtype))


PARENTS = [-1, -1, 0, 0, 1, 2, 4, -1, 5]  # a tree of 9 nodes, depth up to 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_tree_attention_equals_plain_masked(backend, geom, dtype):
    h, g, d = geom
    L, t = 37, len(PARENTS) + 1
    q, k, v = rand_kv(h, g, d, L, t, dtype, seed=5)
    mask = ancestor_mask(PARENTS, DEVICE)
    be = get_backend(backend, DEVICE)
    hta, hta_lse = layer_attention(be, q, k, v, L, mask, d ** -0.5, hybrid=True, need_lse=True)
    full = torch.cat([torch.ones(t, L, dtype=torch.bool, device=DEVICE), mask], 1)
    exp, exp_lse = attention_eager(q, k[:, :L + t], v[:, :L + t], full, d ** -0.5)
    torch.testing.assert_close(hta, exp, **tol(dtype))
    torch.testing.assert_close(hta_lse.float(), exp_lse.float(), **tol(dtype))
    plain, _ = layer_attention(be, q, k, v, L, mask, d ** -0.5, hybrid=False)
    torch.testing.assert_close(plain, exp, **tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_tree_attention_equals_per_branch_causal(backend):
    """Each tree node's output equals causal attention over prefix + its own root-to-node branch."""
    h, g, d = 4, 2, 16
    L, t = 25, len(PARENTS) + 1
    q, k, v = rand_kv(h, g, d, L, t, torch.float32, seed=7)
    out, _ = layer_attention(get_backend(backend, DEVICE), q, k, v, L, ancestor_mask(PARENTS, DEVICE), d ** -0.5)
    for node in range(len(PARENTS)):
        branch, a = [], node
        while a >= 0:
            branch.append(a + 1)
            a = PARENTS[a]
        rows = [0] + branch[::-1]  # root, ..., node (rows of q / staged keys)
        keys = list(range(L)) + [L + r for r in rows]
        qb = q[:, rows]
        exp, _ = attention_eager(qb, k[:, keys], v[:, keys],
                                 torch.ones(len(rows), len(keys), dtype=torch.bool, device=DEVICE).tril(L), d ** -0.5)
        torch.testing.assert_close(out[:, node + 1], exp[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("h,g,t,n", [(4, 4, 1, 1), (8, 2, 5, 5), (6, 3, 4, 12)])
def test_fused_tree_merge_equals_eager_then_merge(dtype, h, g, t, n):
    """tree_attention_merged (fast) == attention_eager over the tree keys, then merge_attention."""
    from specextend.attention.eager import merge_attention
    from specextend.attention.tree_merge import mask_bias, tree_attention_merged

    gen = torch.Generator().manual_seed(h * 100 + n)
    d = 16
    q, k, v = (torch.randn(*s, generator=gen, dtype=dtype) for s in ((h, t, d), (g, n, d), (g, n, d)))
    out_p = torch.randn(h, t, d, generator=gen, dtype=dtype)
    lse_p = torch.randn(h, t, generator=gen, dtype=dtype) * 3
    mask = torch.rand(t, n, generator=gen) < 0.5
    mask[torch.arange(t), n - t + torch.arange(t)] = True  # each query sees its own key
    ref_t, ref_lse_t = attention_eager(q, k, v, mask, 0.25)
    ref, ref_lse = merge_attention(out_p, lse_p, ref_t, ref_lse_t)
    out, lse = tree_attention_merged(q, k, v, mask_bias(mask, h // g, dtype), out_p, lse_p, 0.25, need_lse=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse.to(lse.dtype), atol=tol, rtol=tol)


def test_a_cuda_backend_turns_cudnn_attention_off():
    """cuDNN builds a plan per new shape (a prompt's last chunk): a CUDA backend turns it off; a CPU
    backend leaves PyTorch's setting alone (docs/architecture.md, "Attention backends")."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        get_backend("torch", "cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        get_backend("eager", "cuda")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        get_backend("torch", "cuda")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,t,w", [(0, 40, 8), (5, 33, 8), (20, 17, 8), (100, 64, 16), (3, 9, 4)])
def test_window_blocks_equal_the_masked_call(geom, dtype, L, t, w):
    """attention.window.window_blocks (the windowed chunk in blocks of the window's length, the
    `torch` backend's path where blocks_pay) against its twin, the one masked call over the chunk and
    its window, and the eager reference; a prefix shorter than the window (keys before position 0),
    a last block padded, several blocks."""
    from specextend.attention.backends import TorchBackend
    from specextend.attention.window import blocks_pay, window_blocks

    h, g, d = geom
    q, k, v = rand_kv(h, g, d, L, t, dtype, seed=L + t + w)
    got = window_blocks(q, k, v, L, w, d ** -0.5)
    lo = max(0, L - w + 1)
    pos_q = torch.arange(L, L + t)[:, None]
    pos_k = torch.arange(lo, L + t)[None, :]
    mask = ((pos_k <= pos_q) & (pos_k > pos_q - w)).to(DEVICE)
    twin, _ = TorchBackend().attend(q, k[:, lo:L + t], v[:, lo:L + t], mask, d ** -0.5, False)
    exp, _ = attention_eager(q, k[:, lo:L + t], v[:, lo:L + t], mask, d ** -0.5)
    assert got.shape == (h, t, d)
    torch.testing.assert_close(got, twin, **tol(dtype))
    torch.testing.assert_close(got, exp, **tol(dtype))
    # through layer_attention: the torch backend takes the blocks where they score fewer pairs
    out, _ = layer_attention(get_backend("torch", DEVICE), q, k, v, L, CAUSAL, d ** -0.5, window=w)
    torch.testing.assert_close(out, exp, **tol(dtype))
    assert TorchBackend().takes_window_blocks(t, w, q.device) == (q.device.type == "cpu" and blocks_pay(t, w))


def test_window_blocks_run_on_the_cpu_only():
    """The torch backend (and flash, through its fallback) takes the blocks on the CPU, where they
    paid; on a GPU the masked call ran as fast at 16K and faster at 4K (H200, 2026-12-03)."""
    from specextend.attention.backends import FlashBackend, TorchBackend

    assert TorchBackend().takes_window_blocks(2048, 512, "cpu")
    assert not TorchBackend().takes_window_blocks(2048, 512, "cuda")
    assert not TorchBackend().takes_window_blocks(2048, 512, torch.device("cuda", 1))
    assert not TorchBackend().takes_window_blocks(512, 512, "cpu")
    flash = FlashBackend(kernel=object())  # (no kernel is called: the check reads the device)
    assert flash.takes_window_blocks(2048, 512, "cpu") and not flash.takes_window_blocks(2048, 512, "cuda")


def test_window_blocks_pay_only_where_they_score_fewer_pairs():
    """blocks_pay: the draft's 2,048-row chunks under a 512 window score 1,024 keys a query in blocks
    against 2,559 in one masked call; a chunk no longer than the window, or one just past it (two
    blocks, the second nearly empty), stays one call."""
    from specextend.attention.window import blocks_pay

    assert blocks_pay(2048, 512) and blocks_pay(1024, 512)
    assert not blocks_pay(512, 512) and not blocks_pay(100, 512) and not blocks_pay(513, 512)
    assert not blocks_pay(2048, 0)
