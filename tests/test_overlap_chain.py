"""Chained levels of a background flight (draft/chain.py, `Chained`): after the first level, the
device picks the best children of each level by path score and forwards them without the host.
Twin: the host forwarding the same nodes level by level must leave the same pool and the same
staged K/V (float64: exactly). Output equals plain decoding with chaining on, and chained nodes
are really used.
"""

import pytest
import torch

from specextend.config import RetrievalConfig, TreeConfig
from specextend.draft.base import DraftSessionParams
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.session import DraftSession
from specextend.draft.worker import DraftWorker

TREE = TreeConfig(8, 4, 3)
PLAIN = RetrievalConfig(enabled=False)


def prompt(n=60, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


def forwarded_at(session, lo, hi):
    """Pool nodes forwarded at staged slots lo..hi-1, in slot order."""
    pool = session.pool
    return sorted((i for i in range(len(pool)) if lo <= pool.slots[i] < hi), key=lambda i: pool.slots[i])


@pytest.mark.parametrize("rows", [8, 16])
def test_chained_levels_equal_the_host_forwarding_the_nodes_they_picked(draft, rows):
    params = DraftSessionParams(TREE, PLAIN, 64)
    chained = DraftSession(draft, prompt(), params, overlap=True, overlap_rows=rows, overlap_levels=3)
    host = DraftSession(draft, prompt(), params, overlap=True, overlap_rows=rows)
    chained.step(0, [7], None)
    host.step(0, [7], None)
    start = -(-chained.pool.staged // rows) * rows
    assert chained.background()  # one launch: three forwards
    assert chained.chained_nodes > 0 and chained.pool.staged == start + 3 * rows
    # the host twin: level 1 from its frontier, then the nodes the device picked, level by level
    host.flight = host._launch_forward(host.pool.frontier(rows, 2 * TREE.depth), children=True)
    host.finish()
    for level in (1, 2):
        lo = start + level * rows
        picked = forwarded_at(chained, lo, lo + rows)
        assert picked
        if level == 1:  # the best children of level 1's nodes by path score
            parents = set(forwarded_at(host, start, start + rows))
            cands = sorted((i for i in range(len(host.pool)) if host.pool.parents[i] in parents),
                           key=lambda i: -host.pool.scores[i])
            assert sorted(picked) == sorted(cands[:rows])
        host.flight = host._launch_forward(picked, children=True)
        host.finish()
    a, b = chained.pool, host.pool
    assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths)
    assert a.scores == pytest.approx(b.scores, abs=1e-12)
    used = [i for i in range(len(a)) if a.slots[i] >= 0]
    assert [a.slots[i] for i in used] == [b.slots[i] for i in used]
    slots = torch.tensor([a.slots[i] for i in used], device=chained.work.data.device)
    ka = chained.work.staged(0, a.staged).index_select(3, slots)
    kb = host.work.staged(0, b.staged).index_select(3, slots)
    assert torch.equal(ka, kb)


def test_a_step_answered_from_chained_levels_equals_plain_drafting(draft):
    """The verdict's bonus token forwarded in a chained level: the step is ready, its cache equals a
    session without overlap that committed the same tokens."""
    params = DraftSessionParams(TREE, PLAIN, 64)
    over = DraftSession(draft, prompt(), params, overlap=True, overlap_levels=3)
    plain = DraftSession(draft, prompt(), params)
    t0 = over.step(0, [7], None)
    plain.step(0, [7], None)
    start = -(-over.pool.staged // over.rows) * over.rows
    assert over.background()
    deep = forwarded_at(over, start + 2 * over.rows, start + 3 * over.rows)  # the third level's nodes
    path = over.pool.ancestors(deep[0])
    accepted = [over.pool.tokens[i] for i in path]
    hit, ref = over.step(1, accepted, None), plain.step(1, accepted, None)
    assert hit.ready and not ref.ready and t0.tokens
    n = plain.work.length
    assert over.work.length == n
    assert torch.allclose(over.work.data[:, :, :, :n], plain.work.data[:, :, :, :n], atol=1e-9)  # tree vs causal order


def test_a_step_in_flight_drops_the_chained_levels_not_attached(draft):
    params = DraftSessionParams(TREE, PLAIN, 64)
    s = DraftSession(draft, prompt(), params, overlap=True, overlap_levels=3)
    t0 = s.step(0, [7], None)
    assert s.launch()
    s.flight.held = True  # in flight: nothing attached yet
    first = [n for _, n in s.flight.rows]
    accepted = [s.pool.tokens[first[0]]]
    hit = s.step(1, accepted, None)  # the new root is in the first level: waits for it only
    assert hit.ready and s.flight_waits == 1 and s.dropped_levels == 2 and s.chained_nodes == 0
    assert t0.tokens and s.pool is not None


@pytest.mark.parametrize("mode", ["sd", "specextend"])
def test_chained_overlap_output_equals_plain_decoding(tiny_models, mode):
    from tests.test_overlap import run

    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder, overlap=True, overlap_levels=3)
    ref, out, stats = run(pair, ChaosDraft(worker, Chaos(latency_s=0.05)), mode)
    assert out == ref
    assert stats.ready_steps > 0
    worker.shutdown()
    assert worker.stats().chained_nodes > 0
