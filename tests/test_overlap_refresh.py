"""Retrieval selections under overlapped drafting (docs/architecture.md, "Overlapped drafting"): a
selection that arrives with a ready answer waits for a miss (or `refresh_defer` ready steps), and a
rebuild in the background forwards the pool again over the new working cache; float64."""

import pytest
import torch

from specextend.config import RetrievalConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.session import DraftSession

from test_overlap import TREE, grow, prompt


@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


def ready_step_with_a_selection(draft, defer=0):
    """A session with retrieval whose step 1 is answered from the pool while a retrieval selection
    arrives with it; returns the session and its rebuild count before that step. `defer`: ready
    steps the selection may wait for a miss before the background applies it (0: at once)."""
    from specextend.draft.base import Retrieval

    params = DraftSessionParams(TREE, RetrievalConfig(enabled=True, chunk_size=8, top_k=4, draft_prefill_window=0), 64)
    over = DraftSession(draft, prompt(), params, overlap=True, refresh_defer=defer)
    t0 = over.step(0, [7], None)
    grow(over)
    pool = over.pool
    bonus = next(i for i in pool.children(0) if pool.slots[i] >= 0)
    refreshes = over.refreshes
    hit = over.step(1, [t0.tokens[0], pool.tokens[bonus]], Retrieval((0, 2, 5, 7), 8))
    assert hit.ready and over.refreshes == refreshes  # not yet: the answer came first
    return over, refreshes


def a_hit(session):
    """Tokens of a verdict the session's pool foresaw: a forwarded first-level node and its forwarded child."""
    pool = session.pool
    a = next(i for i in range(len(pool)) if pool.depths[i] == 1 and pool.slots[i] >= 0
             and any(pool.slots[c] >= 0 for c in pool.children(i)))
    b = next(c for c in pool.children(a) if pool.slots[c] >= 0)
    return [pool.tokens[a], pool.tokens[b]]


def test_a_refresh_due_on_a_ready_step_is_applied_after_it_and_restages_the_pool(draft):
    """The retrieval rebuild runs in the background after a ready answer; the pool's nodes are then
    forwarded again over the new working cache: each staged K/V equals a causal forward of its path."""
    import copy

    from specextend.attention.backends import CAUSAL

    over, refreshes = ready_step_with_a_selection(draft)
    grow(over)
    assert over.refreshes == refreshes + 1 and not over._restage and over.pool.forwarded > 0
    w = over.work
    for node in [i for i, s in enumerate(over.pool.slots) if s >= 0][:6]:
        path = over.pool.ancestors(node)
        cache = copy.deepcopy(w)
        ids = torch.tensor([over.pool.tokens[i] for i in path])
        draft.forward(ids, torch.arange(w.length, w.length + len(path)), cache, CAUSAL)
        want = cache.data[:, :, :, w.length + len(path) - 1]  # [layers, 2, G, D]
        got = w.data[:, :, :, w.length + over.pool.slots[node]]
        assert torch.allclose(got, want, atol=1e-9), node


def test_a_selection_waiting_in_the_background_is_applied_by_a_missed_step(draft):
    over, refreshes = ready_step_with_a_selection(draft)
    got = over.step(2, [255, 254], None)  # a miss before the background ran: the selection is not lost
    assert not got.ready and over.refreshes == refreshes + 1


def test_a_deferred_selection_waits_for_a_miss_while_the_pool_grows(draft):
    """With refresh_defer, the background grows the pool instead of rebuilding (a rebuild forwards
    the whole pool again); the next miss applies the selection before it drafts."""
    over, refreshes = ready_step_with_a_selection(draft, defer=4)
    forwarded = over.pool.forwarded
    assert grow(over) > 0 and over.pool.forwarded > forwarded
    assert over.refreshes == refreshes and over._refresh is not None and not over._restage
    got = over.step(2, [255, 254], None)
    assert not got.ready and over.refreshes == refreshes + 1 and over._refresh is None


def test_a_deferred_selection_is_applied_in_the_background_after_its_ready_steps(draft):
    over, refreshes = ready_step_with_a_selection(draft, defer=1)
    grow(over)
    assert over.refreshes == refreshes  # waited one ready step for a miss
    hit = over.step(2, a_hit(over), None)
    assert hit.ready and over.refreshes == refreshes
    grow(over)  # its one ready step has passed: the background rebuilds, then re-stages the pool
    assert over.refreshes == refreshes + 1 and over._refresh is None and not over._restage
