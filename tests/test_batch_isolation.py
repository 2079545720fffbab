"""Batched sessions stay independent (docs/architecture.md, "Batched steps"): context lookup
batched equals each alone, a session that joins while others decode changes nobody's output, and a
session that fails mid-request ends alone while its neighbours' whole outputs equal their solo
runs (float64: exactly)."""

from __future__ import annotations

import threading

from specextend.config import SamplingParams, TreeConfig
from specextend.scheduler import Batcher

from helpers import make_engine
from test_batch import RETRIEVAL, _requests, run_batched


def test_lookup_sessions_batched_equal_each_alone(tiny_models, monkeypatch):
    """Mode lookup (context chains verified, no draft model): prompts that repeat themselves, so
    chains are found and verified in the shared forwards. Every chain found is verified (the gate,
    which weighs measured costs, would make that depend on the host's timing: CI, 2026-11-28)."""
    from specextend.lookup_gate import LookupGate

    monkeypatch.setattr(LookupGate, "use", lambda self, *a, **k: True)
    engine = make_engine(tiny_models("float64"), "lookup")
    reqs = [((p * 3)[:120], params, kw) for p, params, kw in _requests()[:4]]
    alone = [engine.generate(p, params, **k) for p, params, k in reqs]
    got, b = run_batched(engine, reqs, max_batch=4)
    for (tokens, finish, stats), (ref, ref_finish, ref_stats) in zip(got, alone):
        assert tokens == ref and finish == ref_finish and stats.num_steps == ref_stats.num_steps
    assert sum(st.lookup_steps for _, _, st in got) > 0, "no chain was verified"
    assert b.max_calls > 1 and b.calls > b.forwards, "the sessions' forwards were not batched"


class Sinks:
    """Per-session event lists and endings, and an event set when `want` sessions have ended."""

    def __init__(self, want: int) -> None:
        self.outs, self.ends, self.want = {}, {}, want
        self.done = threading.Event()
        self.seen = threading.Event()  # the first session's third event

    def sink(self, name):
        self.outs[name] = []

        def take(item):
            if item is None or isinstance(item, BaseException):
                self.ends[name] = item
                if len(self.ends) == self.want:
                    self.done.set()
            else:
                self.outs[name].append(item)
                if len(self.outs[name]) == 3:
                    self.seen.set()
            return True
        return take

    def tokens(self, name):
        return [t for ev in self.outs[name] for t in ev.token_ids]


def test_a_session_that_joins_mid_decode_changes_nobody(tiny_models):
    engine = make_engine(tiny_models("float64"), "specextend", tree=TreeConfig(12, 4, 3), prefill_chunk=64,
                         retrieval=RETRIEVAL)
    reqs = [(p, SamplingParams(max_new_tokens=40, ignore_eos=True), k) for p, _, k in _requests()[:3]]
    alone = [engine.generate(p, params, **k)[0] for p, params, k in reqs]
    b = Batcher(engine.target.decoder, 4)
    sinks = Sinks(3)
    for i, (p, params, kw) in enumerate(reqs[:2]):
        b.add(engine.session(p, params, **kw), sinks.sink(i))
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    assert sinks.seen.wait(60)
    late_p, late_params, late_kw = reqs[2]
    b.add(engine.session(late_p, late_params, **late_kw), sinks.sink(2))  # while the others decode
    assert sinks.done.wait(120)
    b.shutdown()
    thread.join(10)
    assert all(end is None for end in sinks.ends.values()), sinks.ends
    assert [sinks.tokens(i) for i in range(3)] == alone
    assert len(sinks.outs[0]) > 3  # (the first was still decoding when the third joined)


def failing_after(gen, n):
    """The session's coroutine (its forwards, draft calls and events), failing after n of them: a
    bug inside one request's step."""
    item = next(gen)
    for _ in range(n):
        item = gen.send((yield item))
    gen.close()
    raise RuntimeError("injected failure in one session")


def test_a_session_that_fails_ends_alone_and_its_neighbours_are_whole(tiny_models):
    engine = make_engine(tiny_models("float64"), "sd", tree=TreeConfig(12, 4, 3), prefill_chunk=64)
    reqs = _requests()[:4]
    alone = [engine.generate(p, params, **k)[0] for p, params, k in reqs]
    b = Batcher(engine.target.decoder, 4)
    sinks = Sinks(4)
    for i, (p, params, kw) in enumerate(reqs):
        session = engine.session(p, params, **kw)
        b.add(failing_after(session, 12) if i == 1 else session, sinks.sink(i))
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    assert sinks.done.wait(120)
    assert isinstance(sinks.ends[1], RuntimeError) and "injected" in str(sinks.ends[1])
    assert 0 < len(sinks.tokens(1)) < len(alone[1])  # it failed mid-request
    for i in (0, 2, 3):
        assert sinks.ends[i] is None and sinks.tokens(i) == alone[i]
    # the batcher still serves: a later request equals its solo run
    p, params, kw = reqs[1][0], SamplingParams(max_new_tokens=6, ignore_eos=True), {}
    more = Sinks(1)
    b.add(engine.session(p, params, **kw), more.sink("again"))
    assert more.done.wait(60) and more.ends["again"] is None
    assert more.tokens("again") == engine.generate(p, params)[0]
    b.shutdown()
    thread.join(10)
    for _ in range(100):  # every draft session closed, the failed one's too
        if engine.draft.num_sessions == 0:
            break
        threading.Event().wait(0.05)
    assert engine.draft.num_sessions == 0


def test_a_round_carries_prompt_chunks_within_its_token_budget(tiny_models):
    """With `max_tokens`, a round carries every session's step and prompt chunks while its rows
    fit, at least one chunk: long prompts arriving together prefill a chunk or two a round while
    the sessions already decoding step every round; every output equals its solo run."""
    from specextend.models.batch import forward_batch

    # (no prefix cache: the solo runs would leave the long prompts' chunks cached, and the rounds carry none)
    engine = make_engine(tiny_models("float64"), "ar", prefill_chunk=32, prefix_cache_gb=0)
    rounds = []

    def recording(model, calls):
        rounds.append([(c.prompt, c.ids.shape[0]) for c in calls])
        return forward_batch(model, calls)

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    short = [_requests()[0][0], _requests()[4][0]]  # 3 and 9 tokens: one chunk each
    long = [(p * 3)[:100] for p, _, _ in _requests()[1:4]]  # 100 tokens: four chunks each
    alone = [engine.generate(p, params)[0] for p in short + long]
    b = Batcher(engine.target.decoder, 8, forward=recording, max_tokens=40)
    sinks = Sinks(5)
    for i, p in enumerate(short):
        b.add(engine.session(p, params), sinks.sink(i))
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    assert sinks.seen.wait(60)  # the short ones decode ...
    for i, p in enumerate(long):  # ... when three long prompts arrive together
        b.add(engine.session(p, params), sinks.sink(2 + i))
    assert sinks.done.wait(120)
    b.shutdown()
    thread.join(10)
    assert all(end is None for end in sinks.ends.values()), sinks.ends
    assert [sinks.tokens(i) for i in range(5)] == alone
    assert b.held_chunks > 0
    for calls in rounds:  # within the budget, or a single chunk beside the steps
        chunks = [n for prompt, n in calls if prompt]
        assert sum(n for _, n in calls) <= 40 or len(chunks) == 1, calls
    both = [calls for calls in rounds if any(p for p, _ in calls) and sum(not p for p, _ in calls) == 2]
    assert both, "no round carried a chunk beside both decoding sessions' steps"
