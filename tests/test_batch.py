"""Batched steps: forward_batch against its slow twin (one forward per call), and the batched
engine against each request run alone (docs/architecture.md, "Batched steps")."""

from __future__ import annotations

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.models.batch import ForwardCall, forward_batch, forward_each
from specextend.models.decoder import ForwardOptions
from specextend.tree import ancestor_mask, node_depths

from helpers import CONFIGS, build_pair


def _calls(dec, seed: int):
    """A prefill chunk over a half-filled cache, a decode token, a tree with LSE capture and a
    windowed causal chunk with a store: every kind of forward a step makes, each on its own cache."""
    g = torch.Generator().manual_seed(seed)
    V = dec.args.vocab_size

    def cache_with(n):
        c = dec.new_cache(96)
        if n:
            dec.forward(torch.randint(V, (n,), generator=g), torch.arange(n), c, CAUSAL)
            c.advance(n)
        return c

    parents = [-1, -1, 0, 0, 2, 1]
    depths = torch.tensor([0] + node_depths(parents))
    c_tree = cache_with(11)
    store = dec.new_cache(96)
    return [
        ForwardCall(torch.randint(V, (7,), generator=g), torch.arange(5, 12), cache_with(5), CAUSAL,
                    ForwardOptions(logits_rows=torch.tensor([6]))),
        ForwardCall(torch.randint(V, (1,), generator=g), torch.tensor([20]), cache_with(20), CAUSAL),
        ForwardCall(torch.randint(V, (7,), generator=g), 11 + depths, c_tree, ancestor_mask(parents, "cpu"),
                    ForwardOptions(capture_last=True)),
        ForwardCall(torch.randint(V, (4,), generator=g), torch.arange(30, 34), cache_with(30), CAUSAL,
                    ForwardOptions(window=8, store=store, hybrid=False)),
    ]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_forward_batch_equals_each(arch):
    _, dec = build_pair(arch)
    dec.w = dec.w.to(dtype=torch.float64)
    batch, each = _calls(dec, 1), _calls(dec, 1)
    got, want = forward_batch(dec, batch), forward_each(dec, each)
    assert len(got) == len(want) == 4
    for (lg, cg), (lw, cw), b, e in zip(got, want, batch, each):
        assert lg.shape == lw.shape
        torch.testing.assert_close(lg, lw, rtol=1e-10, atol=1e-10)
        assert (cg is None) == (cw is None)
        if cg is not None:
            torch.testing.assert_close(cg.q, cw.q, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(cg.lse, cw.lse, rtol=1e-10, atol=1e-10)
        n = b.cache.length + b.ids.shape[0]  # the staged K/V, too
        torch.testing.assert_close(b.cache.data[..., :n, :], e.cache.data[..., :n, :], rtol=1e-10, atol=1e-10)
        if b.opts.store is not None:
            torch.testing.assert_close(b.opts.store.data, e.opts.store.data, rtol=1e-10, atol=1e-10)
