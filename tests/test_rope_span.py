"""Rope.span (a cached table of cos/sin, grown on demand) against Rope.cos_sin, its slow twin."""

import pytest
import torch

from specextend.models.rope import Rope, apply_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_span_equals_cos_sin_at_any_offset(dtype):
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    rope = Rope(inv, scaling=1.25)
    for lo, n in [(0, 5), (1000, 30), (3, 1), (5000, 7), (0, 1)]:  # 5000 + 7 grows the table
        cos, sin = rope.span(lo, n, dtype)
        ref_cos, ref_sin = rope.cos_sin(torch.arange(lo, lo + n), dtype)
        assert cos.shape == (n, 16) and cos.dtype == dtype
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        _, neg = rope.span(lo, n, dtype, inverse=True)
        assert torch.equal(neg, -ref_sin)
    assert rope._tables[dtype][0].shape[0] == 8192


def test_inverse_span_undoes_the_rotation():
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    rope = Rope(inv, scaling=0.8)
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    cos, sin = rope.span(100, 6, torch.float64)
    icos, isin = rope.span(100, 6, torch.float64, inverse=True)
    back = apply_rope(apply_rope(x, cos, sin), icos, isin) / rope.scaling ** 2
    torch.testing.assert_close(back, x)
    assert not torch.allclose(apply_rope(x, cos, sin), x)
