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
    tile = skinny.Tile(bn=16, bk=64, split=split)
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
    tile = skinny.Tile(bn=16, bk=64, split=4)
    outs = [skinny.linear_residual_(x0.clone(), a, w, tile) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_split_k_refused_with_a_norm_or_glu():
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(AssertionError, match="split-K"):
        skinny.norm_linear(x, torch.ones(64, device=DEVICE), 1e-6, torch.randn(32, 64).to(DEVICE),
                           tile=skinny.Tile(bn=16, bk=16, split=2))


def test_default_tiles_split_narrow_long_projections_only():
    down = skinny.default_tile("res", 4, 896, 4864)  # the 0.5B draft's down projection: 56 blocks
    assert down.bn == 16 and down.split == 4 and 56 * down.split >= 132
    assert skinny.default_tile("res", 4, 896, 896).split == 2  # its o-projection: 7 BK steps
    assert skinny.default_tile("glu", 4, 4864, 896).split == 1  # the norm needs all of K
    assert skinny.default_tile("res", 1, 8192, 4096).split == 1  # wide enough already
    for kind in skinny.KINDS:  # candidates: the default first, each at most once
        cands = skinny.candidates(kind, 4, 896, 4864, 132, False)
        assert cands[0] == skinny.default_tile(kind, 4, 896, 4864) and len(set(cands)) == len(cands)
        assert all(c.split == 1 for c in cands) or kind == "res"


def test_choose_on_the_cpu_is_the_default_tile_and_times_nothing():
    x = torch.randn(4, 96)
    w = torch.randn(40, 96)

    def boom(*_):
        raise AssertionError("timed on the CPU")
    assert skinny.choose("res", x, w, boom, boom, 40) == skinny.default_tile("res", 4, 40, 96, ieee=True)


def test_config_gives_narrow_outputs_more_programs():
    assert skinny.config(4, 896, 4864)["BN"] == 16  # the 0.5B's down projection: 56 programs
    assert skinny.config(4, 4864, 896)["BN"] == 32  # its gate/up: 152 programs
    assert skinny.config(1, 151936, 896)["BN"] == 64
    assert skinny.config(17, 64, 64)["BT"] == 32
