"""Skinny fused linear kernels (models/skinny.py) against their torch twin, on the CPU through
Triton's interpreter (conftest.py), on CUDA compiled."""

import pytest
import torch

pytest.importorskip("triton")  # a dev dependency: present in CI

from specextend.models import skinny

from test_full_graphs import DEVICE, DTYPES

TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _rnd(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,n", [(1, 64, 48), (4, 200, 40), (17, 96, 130)])
@pytest.mark.parametrize("norm,bias", [(True, True), (False, False), (True, False)])
def test_norm_linear_equals_twin(dtype, t, k, n, norm, bias):
    """Rows padded to a tile (1, 4, 17 of 16/32), K past one 128-column step and not a multiple of
    it, N not a multiple of the output block; the norm's weight and the bias applied."""
    gen = torch.Generator().manual_seed(t * 1000 + k + n)
    x = _rnd(gen, t, k, dtype=dtype) * 3
    nw = (1 + 0.5 * _rnd(gen, k, dtype=dtype)) if norm else None
    w = _rnd(gen, n, k, dtype=dtype) * 0.1
    b = _rnd(gen, n, dtype=dtype) if bias else None
    got = skinny.norm_linear(x, nw, 1e-6, w, b)
    ref = skinny.reference(x.float(), None if nw is None else nw.float(), 1e-6, w.float(),
                           None if b is None else b.float())
    assert got.shape == (t, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,i", [(1, 64, 80), (5, 160, 48)])
def test_norm_glu_equals_twin(dtype, t, k, i):
    gen = torch.Generator().manual_seed(t + k + i)
    x = _rnd(gen, t, k, dtype=dtype) * 3
    nw = 1 + 0.5 * _rnd(gen, k, dtype=dtype)
    w = _rnd(gen, 2 * i, k, dtype=dtype) * 0.1  # gate rows, then up rows
    got = skinny.norm_glu(x, nw, 1e-6, w)
    ref = skinny.reference(x.float(), nw.float(), 1e-6, w.float(), glu=True)
    assert got.shape == (t, i)
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,n", [(1, 96, 64), (17, 300, 40)])
def test_linear_residual_in_place_equals_twin(dtype, t, k, n):
    gen = torch.Generator().manual_seed(k)
    x = _rnd(gen, t, n, dtype=dtype)
    a = _rnd(gen, t, k, dtype=dtype)
    w = _rnd(gen, n, k, dtype=dtype) * 0.1
    ref = skinny.reference(a.float(), None, 0.0, w.float(), residual=x.float())
    out = skinny.linear_residual_(x, a, w)
    assert out is x  # in place
    torch.testing.assert_close(x.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,n,split", [(4, 300, 40, 2), (1, 512, 24, 4), (17, 1000, 56, 8)])
def test_split_k_residual_equals_twin_and_leaves_counters_zero(dtype, t, k, n, split):
    """Split-K: each program's partial over its K range, the last to arrive sums them in a fixed
    order and adds the residual; K not a multiple of the split's range (a short last split), N
    not of the column block. Called twice on the same counters (as graph replays do): the kernel
    must leave them zero, or the second call's last arrival is never recognised."""
    gen = torch.Generator().manual_seed(k + split)
    a = _rnd(gen, t, k, dtype=dtype)
    w = _rnd(gen, n, k, dtype=dtype) * 0.1
    tile = skinny.Tile(bn=16, split=split)
    for _ in range(2):
        x = _rnd(gen, t, n, dtype=dtype)
        ref = skinny.reference(a.float(), None, 0.0, w.float(), residual=x.float())
        skinny.linear_residual_(x, a, w, tile)
        torch.testing.assert_close(x.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    tiles = -(-n // 16)
    counters = [c for key, c in skinny._COUNTERS.items() if key[1:] == (w.data_ptr(), skinny._pow2(t), tiles)]
    assert len(counters) == 1 and counters[0].shape == (tiles,) and not counters[0].any()


def test_split_k_does_not_depend_on_arrival_order():
    """The sum of the partials is taken in split order by whichever program arrives last: the
    same inputs give bit-identical outputs (float32; the interpreter runs programs in one order,
    so this checks the sum against a split-order reference, not races)."""
    gen = torch.Generator().manual_seed(7)
    a = _rnd(gen, 3, 256, dtype=torch.float32)
    w = _rnd(gen, 40, 256, dtype=torch.float32)
    x0 = _rnd(gen, 3, 40, dtype=torch.float32)
    tile = skinny.Tile(bn=16, split=4)
    outs = [skinny.linear_residual_(x0.clone(), a, w, tile) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_with_the_norm_and_the_glu_equals_twin(dtype, split):
    """Split-K under the norm (each program reads the whole row for its statistics) and the GLU
    (gate and up partials summed before the SiLU)."""
    gen = torch.Generator().manual_seed(split)
    x = _rnd(gen, 5, 200, dtype=dtype) * 3
    nw = 1 + 0.5 * _rnd(gen, 200, dtype=dtype)
    w = _rnd(gen, 96, 200, dtype=dtype) * 0.1
    b = _rnd(gen, 96, dtype=dtype)
    tile = skinny.Tile(bn=16, split=split)
    got = skinny.norm_linear(x, nw, 1e-6, w, b, tile)
    ref = skinny.reference(x.float(), nw.float(), 1e-6, w.float(), b.float())
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    got = skinny.norm_glu(x, nw, 1e-6, w, tile)
    ref = skinny.reference(x.float(), nw.float(), 1e-6, w.float(), glu=True)
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_default_tiles_fit_the_register_budget_and_cover_k():
    for kind, t, n, k in (("res", 4, 896, 4864), ("qkv", 4, 1152, 896), ("glu", 4, 4864, 896),
                          ("res", 1, 1536, 8960), ("glu", 64, 8960, 1536), ("qkv", 17, 2048, 1536)):
        for warps in (4, 8):
            c = skinny.default_tile(kind, t, n, k, warps)
            ks, ksp, split = skinny.k_slice(kind, t, k, c)
            assert ks * split >= k > ks * (split - 1) and ksp >= ks and ks % 32 == 0
            assert ksp * (c.bn * (2 if kind == "glu" else 1) + skinny._pow2(t)) <= skinny.BUDGET[warps]
    assert skinny.default_tile("res", 4, 896, 4864).split == 19  # 256-column slices of the 0.5B's down
    for kind in skinny.KINDS:  # candidates: each at most once, streamed ones, the whole-slice default
        cands = skinny.candidates(kind, 4, 896, 4864)
        assert len(set(cands)) == len(cands) and skinny.default_tile(kind, 4, 896, 4864) in cands
        for c in (c for c in cands if c.bk):
            ks, _, split = skinny.k_slice(kind, 4, 4864, c)
            assert split == c.split and ks >= c.bk


def test_pdl_only_compiled_on_hopper_or_later():
    from specextend import pdl

    assert not skinny.pdl(torch.device("cpu"))
    assert pdl.launch_args(True) == {"launch_pdl": True} and pdl.launch_args(False) == {}
    if torch.cuda.is_available():
        before = pdl.SWITCH
        try:
            pdl.SWITCH = False
            assert not pdl.enabled(torch.device("cuda"))
        finally:
            pdl.SWITCH = before


def test_choose_on_the_cpu_is_the_default_tile_and_times_nothing():
    x = torch.randn(4, 96)
    w = torch.randn(40, 96)

    def boom(*_):
        raise AssertionError("timed on the CPU")
    assert skinny.choose("res", x, w, boom, boom, 40) == skinny.default_tile("res", 4, 40, 96)


LOOP_TILES = [skinny.Tile(bn=16, bk=32), skinny.Tile(bn=32, bk=64, stages=2), skinny.Tile(bn=16, split=3, bk=32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", LOOP_TILES, ids=lambda c: f"bn{c.bn}-s{c.split}-bk{c.bk}")
def test_streamed_kernel_equals_twin(dtype, tile):
    """The streamed kernel (skinny_loop: the weight slice loaded BK columns per loop step) in all
    three uses: K not a multiple of the step (a masked last step) nor of the split's range, N not
    of the column block, rows padded to the tile; without a split the norm's statistics come from
    the loop's own x tiles, with one from a pass over the whole row."""
    # the residual call twice: on the same split-K counters
    _three_uses_equal_twin(dtype, tile, tile.bn + tile.bk + tile.split, n=40, residual_calls=2)


def _three_uses_equal_twin(dtype, tile, seed: int, n: int, residual_calls: int) -> None:
    """norm_linear (norm + bias), norm_glu and linear_residual_ at `tile` against their twin: 5 rows,
    K = 200, N = n; the residual call `residual_calls` times on fresh outputs."""
    gen = torch.Generator().manual_seed(seed)
    t, k = 5, 200
    x = _rnd(gen, t, k, dtype=dtype) * 3
    nw = 1 + 0.5 * _rnd(gen, k, dtype=dtype)
    w = _rnd(gen, 2 * n, k, dtype=dtype) * 0.1
    b = _rnd(gen, n, dtype=dtype)
    got = skinny.norm_linear(x, nw, 1e-6, w[:n].contiguous(), b, tile)
    ref = skinny.reference(x.float(), nw.float(), 1e-6, w[:n].float(), b.float())
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    got = skinny.norm_glu(x, nw, 1e-6, w, tile)
    ref = skinny.reference(x.float(), nw.float(), 1e-6, w.float(), glu=True)
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    for _ in range(residual_calls):
        y = _rnd(gen, t, n, dtype=dtype)
        ref = skinny.reference(x.float(), None, 0.0, w[:n].float(), residual=y.float())
        assert skinny.linear_residual_(y, x, w[:n].contiguous(), tile) is y
        torch.testing.assert_close(y.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_streamed_k_slices_cover_k_in_whole_steps():
    for k, split, bk in ((896, 1, 128), (4864, 4, 256), (200, 3, 32), (8960, 6, 128)):
        ks, ksp, s = skinny.k_slice("res", 4, k, skinny.Tile(16, split, bk=bk))
        assert ks % bk == 0 and ks == ksp and ks * s >= k > ks * (s - 1) and s <= split


TILES_TILES = [skinny.Tile(bn=16, bk=32, programs=2), skinny.Tile(bn=16, bk=64, stages=2, programs=3),
               skinny.Tile(bn=32, bk=128, programs=64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", TILES_TILES, ids=lambda c: f"bn{c.bn}-bk{c.bk}-p{c.programs}")
def test_persistent_tiles_kernel_equals_twin(dtype, tile):
    """The persistent kernel (skinny_tiles: P programs, each one loop over its column blocks'
    K chunks) in all three uses: blocks shared unevenly (2 or 3 programs for 3-5 blocks), more
    programs asked for than there are blocks, K not a multiple of the chunk (a masked last unit),
    N not of the column block, rows padded to the tile. Each block's epilogue is stored by the
    unit that ends it and its sums reset: a block that kept its predecessor's sums, or stored an
    unfinished sum, differs from the twin."""
    _three_uses_equal_twin(dtype, tile, tile.bn + tile.bk + tile.programs, n=72, residual_calls=1)
