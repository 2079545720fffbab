"""KVCache's named operations: the all-layer ones the step graphs use equal the per-layer ones."""

import pytest
import torch

from specextend.kv_cache import CacheFull, KVCache


def _kv(layers, g, t, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, g, t, d, generator=gen), torch.randn(layers, g, t, d, generator=gen)


def test_stage_all_equals_stage_per_layer_and_views_read_back():
    a, b = KVCache(3, 2, 4, 10, torch.float32), KVCache(3, 2, 4, 10, torch.float32)  # layers, G, D, capacity
    for c in (a, b):
        c.advance(2)
    k, v = _kv(3, 2, 5, 4, 0)
    a.stage_all(k, v, offset=1)
    for i in range(3):
        b.stage(i, k[i], v[i], offset=1)
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.staged(1, 5), torch.stack([k, v], dim=1))  # [layers, 2, G, T, D]
    a.commit(torch.tensor([1, 3]))  # staged offsets 1 and 3: k[:, :, 0] and k[:, :, 2]
    assert a.committed().shape == (3, 2, 2, 4, 4)
    assert torch.equal(a.committed()[:, 0, :, 2:], k[:, :, [0, 2]])
    assert torch.equal(a.committed()[:, 1, :, 2:], v[:, :, [0, 2]])


def test_stage_all_refuses_to_overflow():
    c = KVCache(1, 1, 2, 6, torch.float32)
    c.advance(4)
    k, v = _kv(1, 1, 2, 2, 1)
    with pytest.raises(CacheFull, match="5 \\+ 2 > 6"):
        c.stage_all(k, v, offset=1)
    assert not c.data.any()  # nothing written
