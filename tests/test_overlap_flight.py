"""A background forward launched and finished apart (draft/overlap.py); the pinned copies it uses
are tested in test_transfer.py. A step that arrives while a background forward is in flight is
answered from the host pool, the forward's pending children join the re-rooted pool later, and
output equals plain decoding (float64: exactly) under every interleaving forced here. On the CPU
a forward is done when launched, so `Flight.held` (done only once waited on) keeps it "in flight".
"""

import copy
import time

import pytest
import torch

from specextend.attention.backends import CAUSAL
from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftError, DraftSessionParams, Retrieval
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.overlap import remap_rows
from specextend.draft.session import DraftSession, SectionTimer
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from test_overlap import concurrently

TREE = TreeConfig(8, 4, 3)
PLAIN = RetrievalConfig(enabled=False)
CMR = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, draft_prefill_window=0)


def prompt(n=60, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


# ------------------------------------------------------------------ pure parts

def test_remap_rows_follows_the_reroot_and_drops_pruned_nodes():
    assert remap_rows([(0, 5), (1, 9), (2, 3)], {3: -1, 5: 0, 7: 1}) == ([(0, 0)], 2)  # 9 pruned, 3 the root
    assert remap_rows([], {3: -1}) == ([], 0)


# ------------------------------------------------------------------ one session, forced "in flight"

def grown(draft, retrieval=PLAIN, slices=1, seed=0, **kw):
    """A session after step 0 and `slices` background forwards, then one more launched and held."""
    s = DraftSession(draft, prompt(seed=seed), DraftSessionParams(TREE, retrieval, 64), overlap=True, **kw)
    t0 = s.step(0, [7], None)
    for _ in range(slices):
        assert s.background()
    assert s.launch()
    s.flight.held = True
    return s, t0


def twin(session):
    """The same session with its flight finished before anything else (the reference). On a GPU
    the flight's events are not copyable: the original's forward is waited for (its `held` flag,
    what keeps it "in flight" here, is untouched) and the copy's events are None (done)."""
    memo = {id(session.model): session.model,  # the model (and its graphs) shared
            id(session.rebuild_timer): SectionTimer(session.model.device)}  # CUDA events inside
    flight = session.flight
    if flight is not None:
        flight.wait()
        for event in [flight.event] + [c.event for c in flight.deeper]:
            if event is not None:
                memo[id(event)] = None
    other = copy.deepcopy(session, memo)
    other.flight.held = False
    other.finish()
    return other


def in_flight(s):
    return [n for _, n in s.flight.rows]


def path_tokens(pool, node):
    return [pool.tokens[i] for i in pool.ancestors(node)]


def canonical(pool):
    """{token path from the root: (score, forwarded)}: a pool whatever its node order."""
    return {tuple(path_tokens(pool, i)): (pool.scores[i], pool.slots[i] >= 0) for i in range(len(pool))}


def assert_same_pool(a, b):
    ca, cb = canonical(a), canonical(b)
    assert ca.keys() == cb.keys()
    for key in ca:
        assert ca[key][1] == cb[key][1] and ca[key][0] == pytest.approx(cb[key][0], abs=1e-12), key


@pytest.mark.parametrize("retrieval", [PLAIN, CMR])
def test_a_ready_step_in_flight_answers_at_once_and_the_children_join_later(draft, retrieval):
    """The verdict's new root is forwarded but not in flight; the flight holds nodes below it and
    elsewhere. The step answers from the pool without finishing the flight; finishing it attaches
    the children of the kept nodes (> 0) and drops the others': the pool and caches then equal
    those of a session that finished the forward before the step."""
    s, t0 = grown(draft, retrieval)
    pool, flying = s.pool, in_flight(s)
    x = next(i for i in range(len(pool)) if pool.slots[i] >= 0 and i not in flying
             and any(i in pool.ancestors(n)[:-1] for n in flying)
             and any(i not in pool.ancestors(n) for n in flying))
    ref = twin(s)
    accepted = path_tokens(pool, x)
    hit = s.step(1, accepted, None)
    want = ref.step(1, accepted, None)
    assert hit.ready and want.ready and s.flight_steps == 1 and s.flight_waits == 0
    assert s.flight is not None and s.flight.held  # not waited for
    assert 0 < len(s.flight.rows) < len(flying) and s.dropped_rows == len(flying) - len(s.flight.rows)
    # answered from what was on the host: the pending children are not in the tree yet
    assert len(s.pool) < len(ref.pool)
    s.flight.held = False
    s.finish()
    assert s.late_children > 0
    assert_same_pool(s.pool, ref.pool)
    n = s.work.length + s.pool.staged
    assert s.work.length == ref.work.length and s.pool.staged == ref.pool.staged
    assert torch.equal(s.work.data[:, :, :, :n], ref.work.data[:, :, :, :n])
    if s.store is not None:
        assert torch.equal(s.store.data[:, :, :, :s.store.length], ref.store.data[:, :, :, :ref.store.length])
    # and the next background forward goes on from the merged pool as the reference's does
    assert s.background() and ref.background()
    assert_same_pool(s.pool, ref.pool)


def test_a_ready_step_whose_new_root_is_in_flight_waits_for_it(draft):
    s, _ = grown(draft)
    node = in_flight(s)[0]
    ref = twin(s)
    accepted = path_tokens(s.pool, node)
    hit, want = s.step(1, accepted, None), ref.step(1, accepted, None)
    assert hit.ready and s.flight_waits == 1 and s.flight is None
    assert hit == want and len(hit.tokens) > 0  # the root's children, waited for
    assert torch.equal(s.work.data, ref.work.data)


def test_a_missed_step_in_flight_drops_the_forwards_result(draft):
    s, _ = grown(draft)
    ref = twin(s)
    got, want = s.step(1, [255, 254], None), ref.step(1, [255, 254], None)
    assert not got.ready and got == want and s.flight_steps == 1
    assert s.flight is not None and s.flight.rows == []  # still in flight; its result is dropped
    before = len(s.pool)
    s.flight.held = False
    s.finish()
    assert len(s.pool) == before and s.late_children == 0
    assert_same_pool(s.pool, ref.pool)
    assert torch.equal(s.work.data[:, :, :, :s.work.length], ref.work.data[:, :, :, :ref.work.length])


def test_two_ready_steps_while_one_forward_is_in_flight(draft):
    """The pending rows follow two re-roots in a row."""
    s, _ = grown(draft, slices=2)
    pool, flying = s.pool, in_flight(s)
    deep = max(flying, key=lambda n: pool.depths[n])
    chain = pool.ancestors(deep)[:-1]  # forwarded ancestors of a node in flight
    assert len(chain) >= 2
    ref = twin(s)
    first = path_tokens(pool, chain[0])
    second = [pool.tokens[i] for i in chain[1:]]
    for session in (s, ref):
        assert session.step(1, first, None).ready and session.step(2, second, None).ready
    assert s.flight_steps == 2 and s.flight.rows
    s.flight.held = False
    s.finish()
    assert s.late_children > 0
    assert_same_pool(s.pool, ref.pool)


def staged_kv_matches_a_causal_forward(draft, s, nodes=6):
    w = s.work
    for node in [i for i, slot in enumerate(s.pool.slots) if slot >= 0][:nodes]:
        path = s.pool.ancestors(node)
        cache = copy.deepcopy(w)
        ids = torch.tensor([s.pool.tokens[i] for i in path])
        draft.forward(ids, torch.arange(w.length, w.length + len(path)), cache, CAUSAL)
        want = cache.data[:, :, :, w.length + len(path) - 1]  # [layers, 2, G, D]
        assert torch.allclose(w.data[:, :, :, w.length + s.pool.slots[node]], want, atol=1e-9), node


def test_a_refresh_that_arrives_in_flight_is_applied_after_the_forward(draft):
    """A ready step in flight brings a retrieval selection: the answer comes first; the next slice
    finishes the forward (its children join the re-rooted pool), then rebuilds the working cache,
    then the pool's nodes are forwarded again over it (refresh_defer 0: no waiting for a miss)."""
    s, t0 = grown(draft, CMR, refresh_defer=0)
    pool, flying = s.pool, in_flight(s)
    x = next(i for i in range(len(pool)) if pool.slots[i] >= 0 and i not in flying
             and any(i in pool.ancestors(n)[:-1] for n in flying))
    refreshes = s.refreshes
    hit = s.step(1, path_tokens(pool, x), Retrieval((0, 2, 5, 7), 8))
    assert hit.ready and s.refreshes == refreshes and s._refresh is not None and s.flight.rows
    s.flight.held = False  # the worker launches the next slice only once this one is done
    assert s.launch()  # finishes the flight, then the rebuild
    assert s.late_children > 0 and s.refreshes == refreshes + 1 and s._restage
    while s.background():
        pass
    assert not s._restage and s.pool.forwarded > 0
    staged_kv_matches_a_causal_forward(draft, s)


def test_a_missed_step_in_flight_applies_a_waiting_refresh(draft):
    s, _ = grown(draft, CMR)
    s._refresh = Retrieval((0, 2, 5, 7), 8)  # as left by an earlier ready step
    ref = twin(s)
    refreshes = s.refreshes
    got, want = s.step(1, [255, 254], None), ref.step(1, [255, 254], None)
    assert not got.ready and got == want and s.refreshes == refreshes + 1
    assert torch.equal(s.work.data[:, :, :, :s.work.length], ref.work.data[:, :, :, :ref.work.length])


# ------------------------------------------------------------------ the worker, forced interleavings

class HoldOnePerStep:
    """Every step arrives with a background forward in flight: after each step of a session its
    first `free` background forwards finish as usual; the next is held (not done until waited on)
    until the session's next step has been answered. Records the sessions it saw."""

    def __init__(self, monkeypatch, free=2):
        self.sessions: list[DraftSession] = []
        launched: dict[int, int] = {}
        launch, step_co = DraftSession.launch, DraftSession.step_co

        def held_launch(session):
            more = launch(session)
            n = launched.get(id(session), 0)
            if more and session.flight is not None and n >= free:
                session.flight.held = True
            launched[id(session)] = n + 1
            return more

        def released_step(session, *args, **kwargs):
            if not any(s is session for s in self.sessions):
                self.sessions.append(session)
            tree = yield from step_co(session, *args, **kwargs)
            launched[id(session)] = 0
            if session.flight is not None:
                session.flight.held = False
            return tree

        monkeypatch.setattr(DraftSession, "launch", held_launch)
        monkeypatch.setattr(DraftSession, "step_co", released_step)

    def total(self, name):
        return sum(getattr(s, name) for s in self.sessions)


def run(pair, backend, mode="sd", n=40, seed=3):
    target = pair[0]
    cfg = EngineConfig(mode=mode, tree=TREE, retrieval=RetrievalConfig(chunk_size=8, top_k=10, every=2),
                       tree_policy="fixed")
    ref, _, _ = Engine(EngineConfig(mode="ar"), target, None).generate(prompt(70, seed), SamplingParams(n, ignore_eos=True))
    out, _, stats = Engine(cfg, target, backend).generate(prompt(70, seed), SamplingParams(n, ignore_eos=True))
    return ref, out, stats


@pytest.mark.parametrize("mode", ["sd", "specextend"])
@pytest.mark.parametrize("free", [0, 2])
def test_output_equals_plain_decoding_when_every_step_arrives_in_flight(tiny_models, monkeypatch, mode, free):
    pair = tiny_models("float64")
    hold = HoldOnePerStep(monkeypatch, free)
    # two levels on a miss: its first level is forwarded, so a pool exists to answer from even
    # when every background forward stays in flight (free=0; the default one level forwards none)
    worker = DraftWorker(pair[1].decoder, overlap=True, sync_depth=2)
    ref, out, stats = run(pair, ChaosDraft(worker, Chaos(latency_s=0.03)), mode)
    assert out == ref
    assert hold.total("flight_steps") > 0 and stats.ready_steps > 0
    if free:
        assert hold.total("late_children") > 0  # ready steps in flight, children attached after
    if mode == "specextend":
        assert stats.retrieval_refreshes > 1
    worker.shutdown()
    assert worker.stats().flight_steps == hold.total("flight_steps")


def test_concurrent_sessions_over_grpc_with_steps_in_flight(tiny_models, monkeypatch):
    pair = tiny_models("float64")
    hold = HoldOnePerStep(monkeypatch, free=1)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    results = {}
    with DraftServerThread(worker) as server:
        def one(seed):
            client = GrpcDraftBackend(server.address)
            results[seed] = run(pair, ChaosDraft(client, Chaos(latency_s=0.02)), "specextend", seed=seed)
            client.shutdown()

        concurrently(one, (1, 2))
    for seed, (ref, out, _) in results.items():
        assert out == ref, seed
    assert hold.total("flight_steps") > 0
    worker.shutdown()


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_session_closed_with_a_forward_in_flight(tiny_models, monkeypatch):
    """Closing drops the forward's result; the worker waits for its end before launching more and
    then serves other sessions losslessly."""
    pair = tiny_models("float64")
    hold = HoldOnePerStep(monkeypatch, free=0)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    worker.open("s", prompt(), DraftSessionParams(TREE, PLAIN, 64))
    worker.step("s", 0, [7])
    wait_for(lambda: worker.stats().background_forwards >= 1)
    (closed,) = hold.sessions
    assert closed.flight is not None and closed.flight.held and closed.flight.rows
    forwards = worker.stats().background_forwards
    worker.close("s")
    assert worker.num_sessions == 0 and closed.pool is None and closed.flight.rows == []
    time.sleep(0.05)
    assert worker.stats().background_forwards == forwards  # nothing launched while it is in flight
    closed.flight.held = False
    ref, out, _ = run(pair[:2], worker, "sd")
    assert out == ref and worker.stats().background_forwards > forwards
    assert closed.pool is None and closed.late_children == 0
    worker.shutdown()


def test_a_worker_stopped_with_a_forward_in_flight(tiny_models, monkeypatch):
    pair = tiny_models("float64")
    HoldOnePerStep(monkeypatch, free=0)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    worker.open("s", prompt(), DraftSessionParams(TREE, PLAIN, 64))
    worker.step("s", 0, [7])
    wait_for(lambda: worker.stats().background_forwards >= 1)
    t0 = time.monotonic()
    worker.shutdown()  # the held forward never ends: the worker must not wait for it
    assert time.monotonic() - t0 < 5 and not worker.health()
    with pytest.raises(DraftError, match="stopped"):
        worker.step("s", 1, [1, 2])


def test_warm_up_leaves_nothing_in_flight(draft):
    worker = DraftWorker(draft, overlap=True)
    assert worker.warm_up(DraftSessionParams(TREE, PLAIN, 64)) > 0
    assert worker._flying is None and worker.num_sessions == 0
    worker.shutdown()


# ------------------------------------------------------------------ on a GPU: a hit does not wait

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_ready_step_answers_while_the_forward_is_still_running(tiny_models):
    """With a long kernel queued before a background forward, a ready step (its new root not in
    flight) returns while the forward is still queued: nothing on its path waits for the device."""
    draft = tiny_models("float32")[1].decoder
    params = DraftSessionParams(TREE, CMR, 64)
    for attempt in range(2):  # the first pass captures every graph the second one replays
        s = DraftSession(draft, prompt(), params, overlap=True)
        s.step(0, [7], None)
        assert s.background()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # ~1 s of device time ahead of the forward
        assert s.launch()
        pool, flying = s.pool, in_flight(s)
        x = next(i for i in range(len(pool)) if pool.slots[i] >= 0 and i not in flying)
        hit = s.step(1, path_tokens(pool, x), None)
        if attempt:
            assert hit.ready and s.flight is not None and not s.flight.done()
        torch.cuda.synchronize()
        s.finish()
