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


def test_config_gives_narrow_outputs_more_programs():
    assert skinny.config(4, 896, 4864)["BN"] == 16  # the 0.5B's down projection: 56 programs
    assert skinny.config(4, 4864, 896)["BN"] == 32  # its gate/up: 152 programs
    assert skinny.config(1, 151936, 896)["BN"] == 64
    assert skinny.config(17, 64, 64)["BT"] == 32
