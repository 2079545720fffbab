"""The sessions' caches as slots of one pool (docs/architecture.md, "Batched steps"): the pooled
decode attention against its twin (each call's attention over its own cache), and the slots'
lending and return."""

from __future__ import annotations

import gc

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.kv_pool import KVPool
from specextend.models.batch import ForwardCall, PooledCalls, forward_batch, forward_each
from specextend.models.decoder import ForwardOptions
from specextend.tree import ancestor_mask, node_depths

from helpers import CONFIGS, build_pair


def _filled(dec, cache, n, g):
    dec.forward(torch.randint(dec.args.vocab_size, (n,), generator=g), torch.arange(n), cache, CAUSAL)
    cache.advance(n)
    return cache


def _calls(dec, pool, seed):
    """Plain steps in pool slots (lengths 20, 7, 33, one capturing its last layer), a tree verify
    capturing its last layer and a 3-token causal chain in slots (slot 1 left free: the slots are
    not dense), a plain step on a cache of its own and a windowed chunk with a store in a slot (those
    two go their own way)."""
    g = torch.Generator().manual_seed(seed)
    V = dec.args.vocab_size
    slots = [pool.take(96) for _ in range(7)] if pool is not None else [dec.new_cache(96) for _ in range(7)]
    parents = [-1, -1, 0, 1]
    depths = torch.tensor([0] + node_depths(parents))
    calls = [
        ForwardCall(torch.randint(V, (1,), generator=g), torch.tensor([20]), _filled(dec, slots[0], 20, g), CAUSAL),
        ForwardCall(torch.randint(V, (5,), generator=g), 11 + depths, _filled(dec, slots[2], 11, g),
                    ancestor_mask(parents, "cpu"), ForwardOptions(capture_last=True)),
        ForwardCall(torch.randint(V, (1,), generator=g), torch.tensor([7]), _filled(dec, slots[3], 7, g), CAUSAL,
                    ForwardOptions(capture_last=True)),
        ForwardCall(torch.randint(V, (1,), generator=g), torch.tensor([9]), _filled(dec, dec.new_cache(40), 9, g),
                    CAUSAL),
        ForwardCall(torch.randint(V, (1,), generator=g), torch.tensor([33]), _filled(dec, slots[4], 33, g), CAUSAL),
        ForwardCall(torch.randint(V, (3,), generator=g), torch.arange(15, 18), _filled(dec, slots[5], 15, g), CAUSAL),
        ForwardCall(torch.randint(V, (4,), generator=g), torch.arange(30, 34), _filled(dec, slots[6], 30, g), CAUSAL,
                    ForwardOptions(window=8, store=dec.new_cache(96), hybrid=False)),
    ]
    return calls, slots


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_pooled_calls_equal_each_call_on_its_own_cache(arch):
    _, dec = build_pair(arch)
    dec.w = dec.w.to(dtype=torch.float64)
    pool = KVPool(dec.args, torch.float64, "cpu", slots=7)
    batch, _ = _calls(dec, pool, 1)
    each, _ = _calls(dec, None, 1)
    pooled = PooledCalls.of(dec, batch, [c.ids.shape[0] for c in batch])
    assert pooled is not None and pooled.members == {0, 1, 2, 4, 5}  # (not the own cache, not the store's)
    assert not pooled.batch.dense and pooled.batch.tmax == 5
    got, want = forward_batch(dec, batch), forward_each(dec, each)
    for (lg, cg), (lw, cw), b, e in zip(got, want, batch, each):
        torch.testing.assert_close(lg, lw, rtol=1e-10, atol=1e-10)
        assert (cg is None) == (cw is None)
        if cg is not None:
            torch.testing.assert_close(cg.q, cw.q, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(cg.lse, cw.lse, rtol=1e-10, atol=1e-10)
        n = b.cache.length + b.ids.shape[0]  # the staged K/V too
        torch.testing.assert_close(b.cache.data[..., :n, :], e.cache.data[..., :n, :], rtol=1e-10, atol=1e-10)
        if b.opts.store is not None:
            torch.testing.assert_close(b.opts.store.data, e.opts.store.data, rtol=1e-10, atol=1e-10)


def test_every_call_a_pooled_plain_step():
    _, dec = build_pair(sorted(CONFIGS)[0])
    dec.w = dec.w.to(dtype=torch.float64)
    pool = KVPool(dec.args, torch.float64, "cpu", slots=3)
    g = torch.Generator().manual_seed(3)
    V = dec.args.vocab_size
    own = [_filled(dec, dec.new_cache(64), n, torch.Generator().manual_seed(n)) for n in (5, 12, 30)]
    slots = [_filled(dec, pool.take(64), n, torch.Generator().manual_seed(n)) for n in (5, 12, 30)]
    ids = [torch.randint(V, (1,), generator=g) for _ in range(3)]
    batch = [ForwardCall(t, torch.tensor([c.length]), c, CAUSAL) for t, c in zip(ids, slots)]
    each = [ForwardCall(t, torch.tensor([c.length]), c, CAUSAL) for t, c in zip(ids, own)]
    pooled = PooledCalls.of(dec, batch, [1, 1, 1])
    assert pooled.everything and pooled.batch.dense  # (no scatter, no gather)
    for (lg, _), (lw, _) in zip(forward_batch(dec, batch), forward_each(dec, each)):
        torch.testing.assert_close(lg, lw, rtol=1e-10, atol=1e-10)


def test_slots_are_lent_and_come_back():
    _, dec = build_pair(sorted(CONFIGS)[0])
    pool = KVPool(dec.args, torch.float32, "cpu", slots=2)
    assert pool.take(pool.capacity + 1) is None  # larger than a slot: the caller's own cache
    a, b = pool.take(10), pool.take(10)
    assert (a.slot, b.slot) == (0, 1) and a.capacity == pool.capacity and pool.free == 0
    assert pool.take(10) is None  # every slot lent
    assert a.data.data_ptr() == pool.data[0].data_ptr() and a.data.is_contiguous()
    del a
    gc.collect()
    assert pool.free == 1
    c = pool.take(10)
    assert c.slot == 0
