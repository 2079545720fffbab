"""Overlapped drafting (draft/pool.py, draft/overlap.py, DraftWorker): the draft keeps
expanding its candidate pool while the target verifies and answers the next step from it when the
verdict was foreseen. The target verifies whatever it gets, so output must equal plain decoding
(float64: exactly) under every interleaving forced here, and ready trees must really be used.
"""

import threading
import time

import pytest
import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.draft.base import DraftError, DraftSessionParams
from specextend.draft.chaos import Chaos, ChaosDraft
from specextend.draft.pool import Pool
from specextend.draft.session import DraftSession
from specextend.draft.worker import DraftWorker
from specextend.engine import Engine
from specextend.rpc import DraftServerThread, GrpcDraftBackend
from specextend.tree import node_depths

TREE = TreeConfig(8, 4, 3)


def prompt(n=60, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ the pool (pure bookkeeping)

def small_pool() -> Pool:
    # root -> a(0) b(1); a -> c(2) d(3); c -> e(4); forwarded: a, b, c in that slot order
    pool = Pool.from_expansion([10, 11, 12, 13], [-0.1, -2.0, -0.3, -1.5], [-1, -1, 0, 0], [1, 1, 2, 2],
                               forwarded=[0, 1])
    pool.mark_forwarded([2], 2, 1)
    pool.add_children([2], torch.tensor([[14]]), torch.tensor([[-0.2]]))
    return pool


def test_pool_mask_walk_and_frontier():
    pool = small_pool()
    assert pool.slots == [0, 1, 2, -1, -1] and pool.staged == 3
    assert pool.walk([10, 12, 14]) == [0, 2, 4] and pool.walk([10, 99, 14]) == [0, None, None]
    # e (node 4) at slot 3 sees a (0), c (2) and itself; d sees a and itself
    m = pool.mask([4, 3], 3)
    assert m.tolist() == [[True, False, True, True, False], [True, False, False, False, True]]
    assert pool.frontier(8, max_depth=10) == [4, 3]  # best path score first
    assert pool.frontier(8, max_depth=3) == [3]  # depth 3 is not forwarded under max_depth 3


def test_pool_reroot_keeps_the_subtree_and_its_slots():
    pool = small_pool()
    new, commit, keep = pool.reroot([0, 2])  # path a, then bonus c: the new root is c
    assert commit == [0, 2] and keep == []  # a, c committed; c's only child e was never forwarded
    assert new.tokens == [14] and new.parents == [-1] and new.depths == [1] and new.slots == [-1]
    assert new.scores == pytest.approx([-0.2])
    new2, commit2, keep2 = pool.reroot([0])  # bonus a: keeps c (forwarded), d, e below it
    assert commit2 == [0] and keep2 == [2]
    assert new2.tokens == [12, 13, 14] and new2.parents == [-1, -1, 0] and new2.slots == [0, -1, -1]
    assert new2.depths == [1, 1, 2] and new2.staged == 1


def test_pool_unstage_then_reroot_drops_children_of_unforwarded_nodes():
    pool = small_pool()
    assert pool.unstage() == [0, 1, 2] and pool.staged == 0
    pool.mark_forwarded([0], 0, 1)  # only a re-staged so far
    new, commit, keep = pool.reroot([0])
    assert new.tokens == [12, 13] and keep == []  # e's parent c is not forwarded: dropped


# ------------------------------------------------------------------ one session

@pytest.fixture(scope="module")
def draft(tiny_models):
    return tiny_models("float64")[1].decoder


def grow(session, forwards=50):
    n = 0
    while n < forwards and session.background():
        n += 1
    return n


@pytest.mark.parametrize("retrieval", [False, True])
def test_a_ready_tree_leaves_the_caches_a_plain_step_would(draft, retrieval):
    """After answering from the pool, the committed K/V (and the store's pre-RoPE keys) equal those of
    a session that forwarded the same tokens, and the tree's first level is the draft's top-k."""
    r = RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4, draft_prefill_window=0)
    params = DraftSessionParams(TREE, r, 64)
    over, plain = DraftSession(draft, prompt(), params, overlap=True), DraftSession(draft, prompt(), params, overlap=True)
    t0 = over.step(0, [7], None)
    plain.step(0, [7], None)
    plain.pool = None  # plain drafts every step from scratch (it keeps the pool it drafts, unused)
    assert grow(over) > 0
    # the verdict: the first node accepted, then a forwarded child of it in the pool as the bonus
    pool = over.pool
    a = 0
    bonus = next(i for i in pool.children(a) if pool.slots[i] >= 0)
    accepted = [t0.tokens[0], pool.tokens[bonus]]
    hit = over.step(1, accepted, None)
    ref = plain.step(1, accepted, None)
    assert hit.ready and not ref.ready and hit.ahead_depth >= 1
    assert over.work.length == plain.work.length
    n = plain.work.length
    assert torch.allclose(over.work.data[:, :, :, :n], plain.work.data[:, :, :, :n], atol=1e-9)
    if retrieval:
        assert torch.allclose(over.store.data[:, :, :, :n], plain.store.data[:, :, :, :n], atol=1e-9)
    # the ready pool's first level is the draft's top-k after the new root, with the same scores
    def first_level(pool):
        return sorted((pool.tokens[i], pool.scores[i]) for i in range(len(pool)) if pool.depths[i] == 1)

    got, want = first_level(over.pool), first_level(plain.pool)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)  # float32 logits


@pytest.mark.parametrize("retrieval", [False, True])
def test_a_ready_answer_comes_before_its_kv_moves_and_they_follow_before_any_other_work(draft, retrieval):
    """A ready step driven as the worker drives it (step_co) answers with its re-root's K/V moves
    still pending (`settle`): the caches are untouched until then, and the tree and the caches after
    `settle` equal those of the synchronous step. A background launch runs the pending moves first."""
    from specextend.draft.batch import run_alone

    r = RetrievalConfig(enabled=retrieval, chunk_size=8, top_k=4, draft_prefill_window=0)
    params = DraftSessionParams(TREE, r, 64)
    lazy, eager = DraftSession(draft, prompt(), params, overlap=True), DraftSession(draft, prompt(), params, overlap=True)
    trees = []
    for s in (lazy, eager):
        t0 = s.step(0, [7], None)
        assert grow(s) > 0
        pool = s.pool
        bonus = next(i for i in pool.children(0) if pool.slots[i] >= 0)
        trees.append((t0, [t0.tokens[0], pool.tokens[bonus]]))
    assert trees[0] == trees[1]
    accepted = trees[0][1]
    length, data = lazy.work.length, lazy.work.data.clone()
    hit = run_alone(lazy.step_co(1, accepted, None), draft)
    assert hit.ready and lazy._settle is not None
    assert lazy.work.length == length and torch.equal(lazy.work.data, data)  # nothing moved yet
    ref = eager.step(1, accepted, None)  # the synchronous step settles before it returns
    assert ref.ready and eager._settle is None and hit == ref
    assert hit.draft_cache_tokens == eager.work.length
    assert lazy.launch()  # settles first, then forwards over the moved caches
    lazy.finish()
    assert lazy._settle is None and lazy.work.length == eager.work.length
    n = eager.work.length
    assert torch.equal(lazy.work.data[:, :, :, :n], eager.work.data[:, :, :, :n])
    if retrieval:
        assert torch.equal(lazy.store.data[:, :, :, :n], eager.store.data[:, :, :, :n])


def test_a_missed_verdict_drafts_as_without_overlap(draft):
    """With sync_depth 0 a miss drafts the whole tree, exactly as without overlap (the wider pool
    changes nothing in the selected tree here); with sync_depth 2, only two levels."""
    params = DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64)
    short = DraftSession(draft, prompt(), params, overlap=True, sync_depth=2)
    assert max(node_depths(short.step(0, [7], None).parents)) <= 2
    over = DraftSession(draft, prompt(), params, overlap=True, sync_depth=0)
    plain = DraftSession(draft, prompt(), params)
    over.step(0, [7], None)
    plain.step(0, [7], None)
    grow(over)
    miss = [255, 254]  # not in the pool
    got, ref = over.step(1, miss, None), plain.step(1, miss, None)
    assert not got.ready and (got.tokens, got.parents) == (ref.tokens, ref.parents)
    assert torch.equal(over.work.data[:, :, :, :over.work.length], plain.work.data[:, :, :, :plain.work.length])


# ------------------------------------------------------------------ end to end, float64

def run(pair, backend, mode="sd", n=40, seed=3, **kw):
    target = pair[0]
    # a budget of 80 tokens: the 70-token prompt fits, then refreshes start (the tiny draft accepts
    # next to nothing from a pruned cache, so hits come from the first steps)
    cfg = EngineConfig(mode=mode, tree=TREE, retrieval=RetrievalConfig(chunk_size=8, top_k=10, every=2),
                       tree_policy="fixed", **kw)
    ref, _, _ = Engine(EngineConfig(mode="ar"), target, None).generate(prompt(70, seed), SamplingParams(n, ignore_eos=True))
    out, _, stats = Engine(cfg, target, backend).generate(prompt(70, seed), SamplingParams(n, ignore_eos=True))
    return ref, out, stats


class SlowBackground:
    """Forces the 'slow draft' interleaving: every background forward takes `delay_s` longer."""

    def __init__(self, monkeypatch, delay_s):
        original = DraftSession.launch

        def slow(session):
            time.sleep(delay_s)
            return original(session)

        monkeypatch.setattr(DraftSession, "launch", slow)


@pytest.mark.parametrize("miss", ["plain", "draft"])
@pytest.mark.parametrize("mode", ["sd", "specextend"])
@pytest.mark.parametrize("interleaving", ["slow target", "fast target", "slow draft", "settle first"])
def test_overlapped_output_equals_plain_decoding(tiny_models, monkeypatch, mode, interleaving, miss):
    """"settle first": the twin of answering a ready step before its K/V moves (answer_first=False),
    with a slow target so that ready steps happen. `miss`: an unready step decodes plainly while the
    draft catches up (overlap_miss=plain), or waits for a drafted tree."""
    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder, overlap=True, answer_first=interleaving != "settle first")
    if interleaving == "slow draft":
        SlowBackground(monkeypatch, 0.02)
    latency = {"slow target": 0.05, "fast target": 0.0, "slow draft": 0.0, "settle first": 0.05}[interleaving]
    ref, out, stats = run(pair, ChaosDraft(worker, Chaos(latency_s=latency)), mode, overlap_miss=miss)
    assert out == ref
    if latency > 0:  # the draft had time: ready trees were really used
        assert stats.ready_steps > 0 and stats.draft_ahead_depth > 0
    # the first step finds no pool: unready with overlap_miss=plain, drafted otherwise
    assert (stats.unready_steps > 0) == (miss == "plain") and stats.num_steps > 0
    assert stats.num_steps + stats.unready_steps + 1 >= len(out) // (1 + max(stats.accepted_per_step))
    if mode == "specextend":  # refreshes were due on ready steps too (every 2 verified trees once the context
        # passes the draft's budget; how many trees verify is timing's: loaded runs verified 4 and 6, refreshed once)
        assert stats.retrieval_refreshes >= 1 and (stats.num_steps < 8 or stats.retrieval_refreshes > 1)
    # the per-step records (the benchmarks' wait split) line up with the counters
    assert len(stats.wait_per_step) == len(stats.ready_per_step) == len(stats.refresh_per_step) == stats.num_steps
    assert sum(stats.ready_per_step) == stats.ready_steps and 1e3 * sum(stats.wait_per_step) > 0
    # every selection but maybe the last verify's reached the draft (with a tree, or an unready step)
    delivered = sum(stats.refresh_per_step) + stats.unready_refreshes
    assert stats.retrieval_refreshes - 1 <= delivered <= stats.retrieval_refreshes
    worker.shutdown()


def concurrently(fn, args) -> None:
    """fn(a) for every a, each on its own thread, all at once; returns when all have ended."""
    threads = [threading.Thread(target=fn, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_ready_trees_are_used_over_grpc_with_concurrent_sessions(tiny_models):
    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder, overlap=True)
    results = {}
    with DraftServerThread(worker) as server:
        def one(seed):
            client = GrpcDraftBackend(server.address)
            results[seed] = run(pair, ChaosDraft(client, Chaos(latency_s=0.03)), "specextend", seed=seed)
            client.shutdown()

        concurrently(one, (1, 2, 3))
    for seed, (ref, out, stats) in results.items():
        assert out == ref, seed
    assert sum(stats.ready_steps for _, _, stats in results.values()) > 0
    assert worker.stats().background_forwards > 0 and worker.num_sessions == 0
    worker.shutdown()


def test_a_failing_background_forward_costs_only_its_time(tiny_models, monkeypatch):
    pair = tiny_models("float64")
    calls = []

    def broken(session):
        calls.append(1)
        raise RuntimeError("injected background failure")

    monkeypatch.setattr(DraftSession, "launch", broken)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    ref, out, stats = run(pair, ChaosDraft(worker, Chaos(latency_s=0.01)))
    assert out == ref and calls and not stats.fallback and stats.ready_steps == 0
    worker.shutdown()


def test_draft_failure_mid_speculation_falls_back_losslessly(tiny_models):
    pair = tiny_models("float64")
    worker = DraftWorker(pair[1].decoder, overlap=True)

    class DiesAtStep3(ChaosDraft):  # whether step 3's verdict goes with a step call or a prepare
        def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
            if step == 3:
                raise DraftError("injected: the draft died")
            return super().step(session_id, step, accepted_tokens, retrieval, bound)

        def prepare(self, session_id, step, accepted_tokens, retrieval, due_s):
            if step == 3 and accepted_tokens:
                raise DraftError("injected: the draft died")
            return super().prepare(session_id, step, accepted_tokens, retrieval, due_s)

    ref, out, stats = run(pair, DiesAtStep3(worker, Chaos(latency_s=0.02)))
    assert out == ref and stats.fallback and stats.num_steps + stats.unready_steps == 3  # steps 0-2 answered
    time.sleep(0.05)
    assert worker.num_sessions == 0  # the engine closed the draft's session
    worker.shutdown()


def test_warm_up_runs_the_background_forwards_before_traffic(draft):
    from specextend.draft.session import POOL_SLOTS

    worker = DraftWorker(draft, overlap=True, overlap_rows=8)
    n = worker.warm_up(DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64))
    assert n >= POOL_SLOTS // 8 - 3  # the staged-slot ladder was walked
    assert worker.num_sessions == 0  # the throwaway session is not kept
    assert DraftWorker(draft).warm_up(DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64)) == 0


def test_the_rows_setting_reaches_the_draft_s_background_forwards(tiny_models, monkeypatch):
    """`draft_overlap_rows` (the serve suite's `-rows16`): the worker's sessions take that many pool
    nodes a background forward, and the output stays plain decoding's."""
    from specextend.builder import build_engine

    assert EngineConfig().draft_overlap_rows == 8
    taken = []
    original = DraftSession.launch
    monkeypatch.setattr(DraftSession, "launch", lambda s: taken.append(s.rows) or original(s))
    cfg = EngineConfig(target="random:llama-tiny", draft="random:llama-tiny-draft", dtype="float64",
                       tree=TREE, tree_policy="fixed", draft_overlap=True, draft_overlap_rows=16)
    engine = build_engine(cfg)
    params = SamplingParams(24, ignore_eos=True)
    ref, _, _ = Engine(EngineConfig(mode="ar"), engine.target, None).generate(prompt(70), params)
    out, _, _ = engine.generate(prompt(70), params)
    engine.draft.shutdown()
    assert engine.draft.overlap_rows == 16 and out == ref
    assert taken and set(taken) == {16}


def test_an_arriving_job_preempts_background_work(draft, monkeypatch):
    """Background drafting runs one forward at a time between jobs: a step queued behind it waits
    for at most the slice in flight, however much background work remains."""
    worker = DraftWorker(draft, overlap=True)
    worker.open("s", prompt(), DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64))
    slices = []

    def endless(session):  # a background that always has more to do, 50 ms a slice
        slices.append(time.perf_counter())
        time.sleep(0.05)
        return True

    monkeypatch.setattr(DraftSession, "launch", endless)
    tree = worker.step("s", 0, [7])
    time.sleep(0.2)  # the worker is now busy with background slices
    t0 = time.perf_counter()
    worker.step("s", 1, [tree.tokens[0], 5])
    assert time.perf_counter() - t0 < 1.0  # the slice in flight (50 ms), then the step: not endless
    assert len(slices) >= 3
    worker.close("s")
    n = len(slices)
    time.sleep(0.15)
    assert len(slices) <= n + 1  # a closed session gets no more background work
    worker.shutdown()


def test_a_stopped_worker_fails_calls_instead_of_hanging(draft):
    worker = DraftWorker(draft)
    worker.shutdown()
    with pytest.raises(DraftError, match="stopped"):
        worker.open("s", prompt(), DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64))
    assert not worker.health()


def test_a_job_that_breaks_the_worker_fails_alone(draft, monkeypatch):
    """A failure outside a job's own error handling (a bug) fails that job's caller; the worker's
    thread lives on and serves the next job (a worker thread that died left every later caller
    waiting forever)."""
    from specextend.draft.jobs import JobWorker

    worker = DraftWorker(draft, overlap=True)
    original = JobWorker._run_job
    broken = {"once": True}

    def run_job(self, job, fut):
        if broken.pop("once", False):
            raise RuntimeError("injected: a bug in the worker")
        return original(self, job, fut)

    monkeypatch.setattr(JobWorker, "_run_job", run_job)
    params = DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64)
    with pytest.raises(RuntimeError, match="injected"):
        worker.open("a", prompt(), params)
    worker.open("b", prompt(), params)
    assert worker.step("b", 0, [7], None).tokens and worker.health()
    worker.close("b")
    worker.shutdown()
