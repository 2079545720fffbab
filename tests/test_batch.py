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


# ---------------------------------------------------------------------------- the batched engine
import threading  # noqa: E402

from specextend.config import RetrievalConfig, SamplingParams, TreeConfig  # noqa: E402
from specextend.draft.base import DraftError  # noqa: E402
from specextend.draft.chaos import Chaos, ChaosDraft  # noqa: E402
from specextend.draft.worker import DraftWorker  # noqa: E402
from specextend.scheduler import Batcher  # noqa: E402

from helpers import make_engine  # noqa: E402

RETRIEVAL = RetrievalConfig(enabled=True, chunk_size=8, top_k=4, every=2, draft_prefill_window=16)


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_batched(engine, requests, max_batch=8, **batcher):
    """Every request through one Batcher on its own thread -> (tokens, finish) per request, batcher."""
    b = Batcher(engine.target.decoder, max_batch, **batcher)
    outs = [[] for _ in requests]
    ends: dict = {}
    all_done = threading.Event()

    def sink_for(i):
        def sink(item):
            if item is None or isinstance(item, BaseException):
                ends[i] = item
                if len(ends) == len(requests):
                    all_done.set()
            else:
                outs[i].append(item)
            return True
        return sink

    for i, (p, params, kw) in enumerate(requests):
        kw = dict(kw)
        load = kw.pop("load", None) or b.new_load()  # (the batcher's slots, as the replica's sessions)
        b.add(engine.session(p, params, load=load, **kw), sink_for(i), load)
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    assert all_done.wait(120), "the batcher did not finish every session"
    b.shutdown()
    thread.join(10)
    for i, end in ends.items():
        assert end is None, f"request {i} failed: {end!r}"
    return [([t for ev in evs for t in ev.token_ids], evs[-1].finish_reason, evs[-1].stats) for evs in outs], b


def _requests():
    """Prompts of several lengths (one spans several prefill chunks), greedy and seeded sampling,
    a stop token, per-request speculation off and a bounded tree."""
    reqs = []
    for i, n in enumerate([3, 30, 150, 70, 9, 44]):
        params = SamplingParams(max_new_tokens=12 + 5 * i, ignore_eos=True,
                                **({"temperature": 0.8, "seed": 100 + i} if i % 2 else {}))
        kw = {"speculate": False} if i == 4 else ({"max_tree_nodes": 3} if i == 5 else {})
        reqs.append((_prompt(n, i), params, kw))
    return reqs


@pytest.mark.parametrize("mode", ["ar", "sd", "specextend"])
def test_batched_sessions_equal_each_alone(tiny_models, mode):
    pair = tiny_models("float64")
    kw = dict(retrieval=RETRIEVAL) if mode == "specextend" else {}
    engine = make_engine(pair, mode, tree=TreeConfig(12, 4, 3), prefill_chunk=64, **kw)
    reqs = _requests()
    alone = [engine.generate(p, params, **k) for p, params, k in reqs]
    got, b = run_batched(engine, reqs, max_batch=4)
    for (tokens, finish, stats), (ref, ref_finish, ref_stats) in zip(got, alone):
        assert tokens == ref and finish == ref_finish
        assert stats.num_steps == ref_stats.num_steps and not stats.fallback
    assert b.max_calls == 4, "the sessions' forwards were not batched"
    assert b.calls > b.forwards
    if mode != "ar":  # the draft's steps were batched too (issued together each round)
        st = engine.draft.stats()
        assert st.step_calls > st.step_forwards and st.batched_steps > st.step_batches
    if mode != "ar":  # every draft session closed (the close follows the last step, asynchronously)
        for _ in range(100):
            if engine.draft.num_sessions == 0:
                break
            threading.Event().wait(0.05)
        assert engine.draft.num_sessions == 0


class FailingDraft(ChaosDraft):
    """Fails every step of the sessions named, from their `after`-th step on."""

    def __init__(self, inner, failing: set, after: int):
        super().__init__(inner, Chaos())
        self.failing, self.after = failing, after

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        if session_id in self.failing and step >= self.after:
            raise DraftError("injected")
        return super().step(session_id, step, accepted_tokens, retrieval, bound)


def test_batched_draft_failure_falls_back(tiny_models):
    """A draft that fails mid-request: that session goes on plainly (lossless), the others speculate."""
    pair = tiny_models("float64")
    ar = make_engine(pair, "ar")
    engine = make_engine(pair, "sd", draft_backend=FailingDraft(DraftWorker(pair[1].decoder), {"s1"}, 2))
    reqs = [(p, params, {**k, "session_id": f"s{i}"}) for i, (p, params, k) in enumerate(_requests()[:4])]
    got, _ = run_batched(engine, reqs)
    for (tokens, finish, stats), (p, params, k) in zip(got, reqs):
        assert (tokens, finish) == ar.generate(p, params)[:2]
    assert [stats.fallback for _, _, stats in got] == [False, True, False, False]


class GatedOpen(ChaosDraft):
    """Its sessions' opening (the draft's prefill) waits until `gate` is set."""

    def __init__(self, inner, gate: threading.Event):
        super().__init__(inner, Chaos())
        self.gate = gate

    def open(self, session_id, prompt_ids, params):
        assert self.gate.wait(60)
        super().open(session_id, prompt_ids, params)


def test_a_draft_still_opening_holds_no_other_session(tiny_models):
    pair = tiny_models("float64")
    gate = threading.Event()
    engine = make_engine(pair, "sd", draft_backend=GatedOpen(DraftWorker(pair[1].decoder), gate))
    b = Batcher(engine.target.decoder, 8)
    finished = {}

    def sink_for(name):
        def sink(item):
            if item is None or isinstance(item, BaseException):
                finished[name] = item
            return True
        return sink

    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    b.add(engine.session(_prompt(40, 1), params), sink_for("waits"))
    b.add(engine.session(_prompt(40, 2), params, speculate=False), sink_for("plain"))
    th = threading.Thread(target=b.run, daemon=True)
    th.start()
    for _ in range(600):
        if "plain" in finished:
            break
        threading.Event().wait(0.05)
    assert finished == {"plain": None}  # done while the other's draft is still opening
    gate.set()
    for _ in range(600):
        if "waits" in finished:
            break
        threading.Event().wait(0.05)
    b.shutdown()
    th.join(10)
    assert finished == {"plain": None, "waits": None}


class ThreadNames(ChaosDraft):
    """Records the thread each draft step runs on."""

    def __init__(self, inner):
        super().__init__(inner, Chaos())
        self.threads: list[str] = []

    def step(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return super().step(*args, **kw)


@pytest.mark.parametrize("sessions", [1, 3])
def test_a_lone_draft_step_runs_on_the_batchers_thread_and_concurrent_ones_on_the_pool(tiny_models, sessions):
    """A round that issues one draft step calls it in place (the round waits for it anyway: no thread
    hand-off on the step's path); several leave together from the pool. Output as alone, either way."""
    pair = tiny_models("float64")
    backend = ThreadNames(DraftWorker(pair[1].decoder))
    engine = make_engine(pair, "sd", draft_backend=backend)
    reqs = [(_prompt(30 + i, i), SamplingParams(max_new_tokens=10, ignore_eos=True), {}) for i in range(sessions)]
    got, _ = run_batched(engine, reqs)
    ar = make_engine(pair, "ar")
    for (p, params, _), (tokens, finish, _) in zip(reqs, got):
        assert (tokens, finish) == ar.generate(p, params)[:2]
    on_pool = [n for n in backend.threads if n.startswith("draft-call")]
    if sessions == 1:
        assert backend.threads and not on_pool  # every step on the batcher's thread
    else:
        assert on_pool  # rounds with several sessions' steps


def test_batcher_reports_each_forwards_sessions(tiny_models):
    """The batcher tells its `on_forward` (the replica's metrics) how many sessions each target
    forward carried, and the replica's metrics expose them as a histogram."""
    from specextend.serving.metrics import ReplicaMetrics

    engine = make_engine(tiny_models("float64"), "ar")
    seen = []
    b = Batcher(engine.target.decoder, 4, on_forward=seen.append)
    done = threading.Event()
    ends = []

    def sink(item):
        if item is None or isinstance(item, BaseException):
            ends.append(item)
            if len(ends) == 3:
                done.set()
        return True

    for i in range(3):
        b.add(engine.session(_prompt(12, i), SamplingParams(max_new_tokens=5, ignore_eos=True)), sink)
    while not done.is_set():
        b.run_round()
    assert len(seen) == b.forwards and max(seen) == 3 and sum(seen) == b.calls
    m = ReplicaMetrics(use_ray=False)
    for n in seen:
        m.record_forward(n)
    text = m.exposition()
    assert f"specextend_forward_sessions_count {float(len(seen))}" in text
    assert 'specextend_forward_sessions_bucket{le="2.0"}' in text


def test_a_failed_round_ends_its_sessions_and_the_batcher_goes_on(tiny_models, monkeypatch):
    """An error in the batcher's own round (not a session's, not a forward's) ends that round's
    sessions with the error and leaves the thread serving: a later session completes."""
    engine = make_engine(tiny_models("float64"), "ar")
    b = Batcher(engine.target.decoder, 4)
    ends, done = {}, threading.Event()

    def sink_for(name):
        def sink(item):
            if item is None or isinstance(item, BaseException):
                ends[name] = item
                done.set()
            return True
        return sink

    calls = {"n": 0}
    real = Batcher._tell_loads

    def broken_once(group, span):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected round failure")
        real(group, span)

    monkeypatch.setattr(Batcher, "_tell_loads", staticmethod(broken_once))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    b.add(engine.session(_prompt(12, 1), params), sink_for("first"))
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    assert done.wait(30)
    assert isinstance(ends["first"], RuntimeError) and "injected" in str(ends["first"])
    done.clear()
    b.add(engine.session(_prompt(12, 2), params), sink_for("second"))
    assert done.wait(30) and ends["second"] is None  # the thread still serves
    b.shutdown()
    thread.join(10)
