"""Early asks (docs/architecture.md, "Overlapped drafting"): with an overlapping draft, a tree step's
verdict goes to the draft as soon as it is known (a ready-only step call for the full tree, in
flight), and the next step reads its answer: its tree if the next step is a tree step, a tell if it
is a plain one. Lossless (float64: exactly), every token reaches the draft once and in order, one
call per step number, the close after the last call, and a draft that fails on an early ask leaves
plain decoding."""

from __future__ import annotations


import pytest

from specextend.config import RetrievalConfig, SamplingParams
from specextend.controller import TreeController
from specextend.draft.worker import DraftWorker
from specextend.draft_link import TELL_BOUND
from specextend.ladder import PLAIN, ladder

from test_told import Recorder, Runs, TreesOnly, assert_calls_in_order, engine_for, prompt, recorded_run


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("lookup", [0, 8])
@pytest.mark.parametrize("policy", [Runs, TreesOnly])
def test_early_asks_are_lossless_and_every_token_reaches_the_draft_once_in_order(pair, sampling, lookup, policy):
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=7)
    # answers come late: the next step must wait for them
    ref, out, stats, draft = recorded_run(pair, policy, params, 0.002, lookup_tokens=lookup)
    assert out == ref
    assert stats.asked_steps > 0  # trees that came from a verdict's early ask
    assert stats.ready_steps > 0  # ready ones among them, verified
    assert stats.asked_steps <= stats.num_steps + stats.unready_steps
    assert_calls_in_order(draft, out, unsent=8)  # an ask takes its number at once; the close after one in flight
    asks = [b for _, _, b in draft.calls if b != TELL_BOUND]
    assert all(b.ready_only for b in asks[1:])


class _Every5(TreeController):
    """Three plain steps, then two that ask for trees (unready ones counted), and again."""

    def choose(self, sessions=1):
        return self.top if (self.spec_steps + self.plain_steps + self.unready_steps) % 5 >= 3 else PLAIN


@pytest.mark.parametrize("lookup", [0, 8])
def test_a_run_s_first_tree_is_asked_at_the_plain_step_before_it(pair, lookup):
    """ask_ahead: after a plain (or unready) step the next step is chosen at once, and a tree's ask
    leaves with that step's tokens, so every tree step reads an early ask's answer, a run's first
    included; lossless, every token sent once and in order."""
    params = SamplingParams(40, ignore_eos=True)
    # (retrieval off: with the other tests' budget of 6 chunks of 8 tokens the tiny draft, its context
    # pruned, proposes nothing the target takes and no verdict is ever in its pool)
    ref, out, stats, draft = recorded_run(pair, _Every5, params, 0.002, lookup_tokens=lookup,
                                          retrieval=RetrievalConfig(enabled=False))
    assert out == ref
    assert stats.num_steps + stats.unready_steps >= 6 and stats.plain_steps >= 6
    assert stats.asked_steps == stats.num_steps + stats.unready_steps  # no tree asked at its own step
    assert stats.ready_steps > 0 and sum(stats.accepted_per_step) > 0  # ready trees, really used
    assert_calls_in_order(draft, out, unsent=8)


def test_each_early_ask_says_where_its_time_went(pair):
    """stats.ask_split (stats.ASK_PARTS): a call answered 2 ms late takes at least that, of which the
    draft side's time is part; the engine's own work before it waited and the hand-offs are times
    too; the response and the bench's line carry the means."""
    from specextend.bench.e2e import ask_line
    from specextend.serving.protocol import SpeculativeDecoding, spec_decoding
    from specextend.stats import ASK_PARTS

    _, _, stats, _ = recorded_run(pair, TreesOnly, SamplingParams(30, ignore_eos=True), 0.002)
    assert len(stats.ask_split) == stats.asked_steps > 0
    for sent, call, draft, queued, flight, overlap, back, wait in stats.ask_split:
        assert min(sent, draft, queued, flight, overlap, back, wait) >= 0
        assert call >= 0.002 and call >= draft >= queued  # (the Recorder sleeps before the draft's step)
    ask = SpeculativeDecoding(**spec_decoding(stats)).model_dump()["ask_ms"]
    assert set(ask) == set(ASK_PARTS) | {"wait_p90"} and ask["call"] >= 2.0
    assert ask["wait_p90"] >= min(1e3 * s[-1] for s in stats.ask_split)
    assert "call " in ask_line(ask) and "flight" in ask_line(ask)


def test_with_early_asks_off_each_tree_step_asks_for_its_own_tree(pair):
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker)
    engine = engine_for(pair, draft, draft_ask_early=False)
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    _, _, stats = engine.generate(prompt(), SamplingParams(30, ignore_eos=True))
    worker.shutdown()
    assert stats.asked_steps == 0 and stats.num_steps > 0


class _TreeThenPlain(TreeController):
    """A tree, then plain steps: the tree's early ask becomes the next plain step's tell."""

    def choose(self, sessions=1):
        return self.top if self.spec_steps + self.plain_steps + self.unready_steps == 0 else PLAIN


def test_an_ask_that_a_plain_step_follows_is_a_tell(pair):
    from helpers import make_engine

    params = SamplingParams(12, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, delay_s=0.01)
    engine = engine_for(pair, draft)
    engine.new_controller = lambda tree: _TreeThenPlain(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref
    assert stats.asked_steps == 0  # asked once, but no tree step read it
    steps = [s for s, _, _ in draft.calls]
    assert steps == list(range(len(steps)))
    sent = [t for _, tokens, _ in draft.calls for t in tokens]
    assert sent == out[:len(sent)]


def test_a_draft_failing_on_an_early_ask_leaves_plain_decoding(pair):
    from helpers import make_engine

    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, fail_at=1)  # step 0: the first tree's call; step 1: its verdict's early ask
    engine = engine_for(pair, draft)
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref and stats.fallback
    assert max(s for s, _, _ in draft.calls) <= 1  # nothing asked of the draft after the failure surfaced


class _Selections(Recorder):
    """Also records each call's retrieval selection."""

    def __init__(self, inner):
        super().__init__(inner)
        self.selections = []

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        self.selections.append(retrieval)
        return super().step(session_id, step, accepted_tokens, retrieval, bound)


@pytest.mark.parametrize("policy", [Runs, TreesOnly])
def test_an_early_ask_leaves_before_the_retrieval_scoring_and_the_selection_goes_with_the_next_call(
        pair, policy, monkeypatch):
    """The ask goes at once after the verdict, before the step's retrieval scoring; the selection
    scored after it is kept until a call carries it (the next ask, tell or tree call), none dropped
    but the last, whatever the next steps are."""
    from helpers import make_engine
    from specextend.draft_link import Lane
    from specextend.target import TargetSession

    # 96 tokens: with Runs on this CPU 7-8 trees verified (with 40, 2: a loaded CI machine once made it 1
    # and the selections 2, under the bound below; 2026-11-29)
    params = SamplingParams(96, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    import specextend.engine_steps as eng

    events = []  # on the engine's thread, in order: tree verdicts, calls queued on the lane, scorings
    submit, score, verify = Lane.submit, TargetSession.timed_selection, eng.verify_tree
    monkeypatch.setattr(Lane, "submit", lambda self, *a: events.append("lane") or submit(self, *a))
    monkeypatch.setattr(TargetSession, "timed_selection", lambda self, *a: events.append("score") or score(self, *a))
    monkeypatch.setattr(eng, "verify_tree", lambda *a: events.append("verdict") or verify(*a))
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = _Selections(worker)
    # a selection at every verification (refreshes count verifications: few trees are ready here)
    engine = engine_for(pair, draft, retrieval=RetrievalConfig(chunk_size=8, top_k=6, every=1))
    engine.new_controller = lambda tree: policy(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref and stats.asked_steps > 0 and stats.retrieval_refreshes > 2
    steps = list(zip(events, events[1:], events[2:]))
    assert ("verdict", "lane", "score") in steps  # a tree step's ask, then its scoring
    assert ("verdict", "score", "lane") not in steps  # never the scoring first
    sent = [r for r in draft.selections[1:] if r is not None]  # (the first call: the prefill's selection)
    assert stats.retrieval_refreshes - 1 <= len(sent) <= stats.retrieval_refreshes
    every = [r for r in draft.selections if r is not None]
    assert all(a is not b for a, b in zip(every, every[1:]))  # each sent once, not again by the next call


@pytest.mark.parametrize("sampling", [False, True])
def test_early_asks_begin_on_the_engines_thread_where_the_lane_is_idle(pair, sampling):
    """With a backend that can begin a step at once (DraftBackend.start_step: here the worker, in
    process), an early ask made while the session's lane is idle is queued on the draft from the
    engine's thread, no hand-off to a call thread (its `sent` part 0); lossless as ever."""
    from helpers import make_engine
    from test_told import engine_for, prompt

    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=7)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    started = []

    class Counting(DraftWorker):
        def start_step(self, *args):
            fut = super().start_step(*args)
            started.append(fut)
            return fut

    worker = Counting(pair[1].decoder, overlap=True)
    engine = engine_for(pair, worker)
    engine.new_controller = lambda tree: TreesOnly(ladder(tree))
    out, _, stats = engine.generate(prompt(), params)
    worker.shutdown()
    assert out == ref
    assert stats.asked_steps > 0 and len(started) >= stats.asked_steps
    assert all(f.submitted == f.started <= f.ended for f in started)
    assert all(sent == 0.0 for sent, *_ in stats.ask_split)


def test_an_ask_begins_at_once_only_behind_an_idle_lane():
    """draft_link.start_ask: behind calls still running (or one that failed) the ask is the lane's next
    call, so it reaches the draft after them; behind an idle lane it begins on the caller's thread and
    becomes the lane's tail; a backend that cannot begin one gets a lane call, and so does one carrying
    a retrieval selection whose ids are still on their way from the device."""
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor

    from specextend.draft_link import Lane, start_ask

    order, gate = [], threading.Event()

    class Backend:
        can_start = True

        def step(self, *args):
            if args[1] == 0:
                gate.wait(5)
            order.append(("step", args[1]))
            return args[1]

        def start_step(self, *args):
            if not self.can_start:
                return None
            order.append(("start", args[1]))
            fut = Future()
            fut.set_result(args[1])
            return fut

    with ThreadPoolExecutor(2) as pool:
        lane, backend = Lane(pool), Backend()
        busy = lane.submit(backend.step, "s", 0)  # running: the lane is not idle
        asked = start_ask(backend, lane, "s", 1, (), None, None)
        assert lane.tail is asked and not lane.idle
        gate.set()
        assert asked.result(5) == 1 and busy.result(5) == 0
        assert order == [("step", 0), ("step", 1)]  # after the call before it, as a lane call
        direct = start_ask(backend, lane, "s", 2, (), None, None)  # idle now: begun here
        assert order[-1] == ("start", 2) and lane.tail is direct and direct.result() == 2
        backend.can_start = False
        assert start_ask(backend, lane, "s", 3, (), None, None).result(5) == 3 and order[-1] == ("step", 3)
        failed = Future()
        failed.set_exception(RuntimeError("draft gone"))
        lane.adopt(failed)
        backend.can_start = True
        with pytest.raises(RuntimeError, match="draft gone"):  # behind a failure: failed the same, unrun
            start_ask(backend, lane, "s", 4, (), None, None).result(5)
        assert order[-1] == ("step", 3)
        lane.adopt(Future())
        lane.tail.set_result(None)  # idle again

        class OnItsWay:  # a retrieval selection whose ids the device has not copied yet
            on_host = False
        assert start_ask(backend, lane, "s", 5, (), OnItsWay(), None).result(5) == 5
        assert order[-1] == ("step", 5)  # a lane call: the caller's thread does not wait for the device
