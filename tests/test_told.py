"""Told verdicts (docs/architecture.md, "Overlapped drafting"): with an overlapping draft, each plain step
sends the tokens committed so far to the draft while its own forward runs (a step call whose
answer is unused), so the draft's pool follows plain and lookup steps and the next tree can be
ready. Lossless (float64: exactly), every token reaches the draft once and in order, a session's
close waits for its last tell, and a draft that fails on a tell leaves plain decoding."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specextend.config import EngineConfig, RetrievalConfig, SamplingParams, TreeConfig
from specextend.controller import TreeController
from specextend.ladder import PLAIN, ladder
from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, TreeBound
from specextend.draft.session import DraftSession
from specextend.draft.worker import DraftWorker
from specextend.draft_link import LANE_BACKLOG, TELL_BOUND
from specextend.engine import Engine

from test_overlap import grow

TREE = TreeConfig(8, 4, 3)


def prompt(n=60, seed=3):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Runs(TreeController):
    """Three plain steps, then two speculative ones, and again (every switch exercised)."""

    def choose(self, sessions=1):
        return self.top if (self.spec_steps + self.plain_steps) % 5 >= 3 else PLAIN


class TreesOnly(TreeController):
    """Every step the full tree."""

    def choose(self, sessions=1):
        return self.top


class Recorder(DraftBackend):
    """Around a real backend: every step call (number, tokens, bound) and when the close came."""

    def __init__(self, inner: DraftBackend, delay_s: float = 0.0, fail_at: int = -1):
        self.inner, self.delay_s, self.fail_at = inner, delay_s, fail_at
        self.calls, self.events, self.lock = [], [], threading.Lock()

    def open(self, session_id, prompt_ids, params):
        return self.inner.open(session_id, prompt_ids, params)

    def step(self, session_id, step, accepted_tokens, retrieval=None, bound=None):
        with self.lock:
            self.calls.append((step, tuple(accepted_tokens), bound))
        time.sleep(self.delay_s)  # a slow answer: the engine must not send the next call before it
        if step == self.fail_at:
            raise DraftError("injected")
        tree = self.inner.step(session_id, step, accepted_tokens, retrieval, bound)
        with self.lock:
            self.events.append(("step", step))
        return tree

    def close(self, session_id):
        with self.lock:
            self.events.append(("close", None))
        self.inner.close(session_id)


def recorded_run(pair, policy, params, delay_s, lookup_ahead=None, **kw):
    """The request under `policy` with a real overlapping worker behind a Recorder answering `delay_s`
    late; waits (up to 5 s) for the session's close. `lookup_ahead`: the engine's (True: lookup runs
    forced on the CPU). -> (ar's ids, the ids, stats, the Recorder)."""
    from helpers import make_engine

    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, delay_s=delay_s)
    engine = engine_for(pair, draft, **kw)
    engine.new_controller = lambda tree: policy(ladder(tree))
    engine.lookup_ahead = lookup_ahead
    out, _, stats = engine.generate(prompt(), params)
    deadline = time.time() + 5
    while ("close", None) not in draft.events and time.time() < deadline:
        time.sleep(0.01)
    worker.shutdown()
    return ref, out, stats, draft


def assert_calls_in_order(draft, out, unsent: int) -> None:
    """One call per step number, in order; each committed token sent once and in order, all but at
    most `unsent` of them; the session's close after every call. Only the last call may carry
    tokens past the output's end: the last step's committed tokens beyond max_tokens' cut (with
    snapshots every step's tokens go at once; a loaded host's timing decides whether the last push
    finds a call in flight and is held, or goes)."""
    steps = [s for s, _, _ in draft.calls]
    assert steps == list(range(len(steps)))
    sent = [t for _, tokens, _ in draft.calls for t in tokens]
    assert sent[:len(out)] == out[:len(sent)] and len(sent) >= len(out) - unsent
    if len(sent) > len(out):  # (the last call's, only)
        assert len(sent) - len(draft.calls[-1][1]) < len(out)
    kinds = [k for k, _ in draft.events]
    assert kinds[-1] == "close" and kinds.count("close") == 1


def engine_for(pair, backend, **kw) -> Engine:
    cfg = EngineConfig(mode="specextend", tree=TREE, tree_policy="adaptive",
                       **{"retrieval": RetrievalConfig(chunk_size=8, top_k=10, every=2), "lookup_tokens": 0,
                          "draft_overlap": True, "draft_snapshots": False, **kw})
    engine = Engine(cfg, pair[0], backend)
    engine.new_controller = lambda tree: Runs(ladder(tree))
    return engine


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("lookup", [0, 8])
def test_told_plain_steps_are_lossless_and_reach_the_draft_once_in_order(pair, sampling, lookup):
    params = SamplingParams(40, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=7)
    from helpers import make_engine

    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, delay_s=0.002)
    out, _, stats = engine_for(pair, draft, lookup_tokens=lookup).generate(prompt(), params)
    worker.shutdown()
    assert out == ref
    assert stats.told_steps > 0 and stats.plain_steps >= stats.told_steps
    assert stats.num_steps + stats.unready_steps > 0  # trees asked (sampled verdicts are rarely in the pool)
    assert sampling or stats.num_steps > 0  # greedy ones are: trees verified
    steps = [s for s, _, _ in draft.calls]
    assert steps == list(range(len(steps)))  # one call per number, in order
    sent = [t for _, tokens, _ in draft.calls for t in tokens]
    assert sent == out[:len(sent)]  # each committed token sent once, in order
    assert len(sent) >= len(out) - 3  # ... all of them but the last step's
    told = [b == TELL_BOUND for _, _, b in draft.calls]
    assert sum(told) == stats.told_steps
    # after the first call every tree step may take a ready tree: the draft was told everything
    assert all(b.ready_only for _, _, b in draft.calls[1:])


def test_a_close_waits_for_the_last_tell(pair):
    """A request that ends on a plain step leaves its tell in flight; the session's close reaches the
    draft only after it (a step after a close would fail on the draft side)."""
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, delay_s=0.05)
    engine = engine_for(pair, draft)
    engine.new_controller = lambda tree: _AlwaysPlain(ladder(tree))
    out, _, stats = engine.generate(prompt(), SamplingParams(6, ignore_eos=True))
    deadline = time.time() + 5
    while ("close", None) not in draft.events and time.time() < deadline:
        time.sleep(0.01)
    worker.shutdown()
    assert stats.told_steps == LANE_BACKLOG and stats.num_steps == 0  # the rest held back by the slow draft
    kinds = [k for k, _ in draft.events]
    assert kinds == ["step"] * LANE_BACKLOG + ["close"]


class Gated(Recorder):
    """Step calls that do not answer until the test opens the gate."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()

    def step(self, *args, **kw):
        self.gate.wait(10)
        return super().step(*args, **kw)


def test_a_plain_step_never_waits_for_a_tell(pair):
    """Tells go through the session's lane: a step queues its tell and goes on. With every call held
    unanswered, the request still runs to its end (the old way, a step waited for the last tell's
    answer); the lane holds at most LANE_BACKLOG calls, the later plain steps' tokens held back for
    the next call, and the close comes after the held calls."""
    from specextend.session_calls import drive_alone

    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Gated(worker)
    engine = engine_for(pair, draft)
    engine.new_controller = lambda tree: _AlwaysPlain(ladder(tree))
    # the session driven as a batching driver does (Engine.generate would wait for the draft's close)
    with torch.inference_mode():
        events = list(drive_alone(engine.session(prompt(), SamplingParams(8, ignore_eos=True)), pair[0].decoder))
    out, stats = [t for ev in events for t in ev.token_ids], events[-1].stats
    answered = list(draft.events)  # before the gate opens: no call has been answered
    draft.gate.set()
    deadline = time.time() + 5
    while ("close", None) not in draft.events and time.time() < deadline:
        time.sleep(0.01)
    worker.shutdown()
    assert answered == [] and len(out) == 8
    assert stats.told_steps == LANE_BACKLOG == len(draft.calls)
    assert [k for k, _ in draft.events] == ["step"] * LANE_BACKLOG + ["close"]


class _AlwaysPlain(TreeController):
    def choose(self, sessions=1):
        return PLAIN


def test_a_draft_failing_on_a_tell_leaves_plain_decoding(pair):
    from helpers import make_engine

    params = SamplingParams(30, ignore_eos=True)
    ref, _, _ = make_engine(pair, "ar").generate(prompt(), params)
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker, fail_at=1)  # step 1 is the first tell (step 0: the first plain step's)
    out, _, stats = engine_for(pair, draft).generate(prompt(), params)
    worker.shutdown()
    assert out == ref and stats.fallback
    assert max(s for s, _, _ in draft.calls) <= 2  # nothing asked of the draft after the failure surfaced


@pytest.mark.parametrize("overlap,tell", [(False, True), (True, False)])
def test_without_overlap_or_with_tells_off_plain_steps_tell_nothing(pair, overlap, tell):
    """A draft without overlap drafts a tree for any call, and `draft_tell=false` is the A/B: plain
    steps' tokens wait for the next tree's call."""
    worker = DraftWorker(pair[1].decoder, overlap=overlap)
    draft = Recorder(worker)
    engine = engine_for(pair, draft, draft_overlap=overlap, draft_tell=tell)
    out, _, stats = engine.generate(prompt(), SamplingParams(30, ignore_eos=True))
    worker.shutdown()
    assert stats.told_steps == 0 and all(b != TELL_BOUND for _, _, b in draft.calls)
    assert any(len(t) > 1 for _, t, _ in draft.calls)  # plain steps' tokens came with the next tree's call


# ------------------------------------------------------------------ the draft session's side

def test_a_tell_keeps_the_pool_and_the_next_verdict_is_answered_ready(pair):
    """A tell whose token the pool forwarded re-roots the pool (kept, not dropped); after the
    background grows it, the next step's verdict below it is answered from it."""
    draft = pair[1].decoder
    s = DraftSession(draft, prompt(), DraftSessionParams(TREE, RetrievalConfig(enabled=False), 64), overlap=True)
    s.step(0, [7], None)
    grow(s)
    child = next(i for i in range(len(s.pool)) if s.pool.depths[i] == 1 and s.pool.slots[i] >= 0)
    told = s.step(1, [s.pool.tokens[child]], None, TELL_BOUND)
    assert told.ready and len(told.tokens) <= 1 and s.pool is not None
    grow(s)
    nxt = next(i for i in range(len(s.pool)) if s.pool.depths[i] == 1 and s.pool.slots[i] >= 0)
    assert s.step(2, [s.pool.tokens[nxt]], None, TreeBound(ready_only=True)).ready


def test_a_session_closed_during_its_prefill_closes_cleanly(pair):
    """A client gone before the first token (the session closed at its prefill's forward): the
    engine's `finally` runs with no tell ever sent, and the draft session is still closed."""
    from specextend.models.batch import ForwardCall

    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = Recorder(worker)
    co = engine_for(pair, draft).session(prompt(), SamplingParams(8, ignore_eos=True))
    assert isinstance(next(co), ForwardCall)  # the first prefill chunk
    co.close()  # raised UnboundLocalError from the finally before `told` was bound first
    deadline = time.time() + 5
    while ("close", None) not in draft.events and time.time() < deadline:
        time.sleep(0.01)
    worker.shutdown()
    assert ("close", None) in draft.events and not draft.calls


# ------------------------------------------------------------------ the lane itself

def test_a_lane_runs_its_calls_one_at_a_time_in_order_and_fails_the_rest_after_an_error():
    from concurrent.futures import ThreadPoolExecutor

    from specextend.draft_link import Lane

    pool = ThreadPoolExecutor(max_workers=8)
    lane, ran, running = Lane(pool), [], []

    def call(i, delay):
        running.append(i)
        assert len(running) == 1  # never two of a lane's calls at once
        time.sleep(delay)
        ran.append(i)
        running.remove(i)
        if i == 6:
            raise DraftError("injected")
        return i

    futures = [lane.submit(call, i, 0.004 * ((7 * i) % 3)) for i in range(10)]
    assert lane.backlog > 0 and lane.tail is futures[-1]
    assert [f.result() for f in futures[:6]] == list(range(6))
    for f in futures[6:]:
        with pytest.raises(DraftError, match="injected"):
            f.result()
    assert ran == list(range(7))  # the calls after the failed one never ran
    assert isinstance(lane.error(), DraftError) and lane.backlog == 0
    pool.shutdown()


@pytest.mark.parametrize("sampling", [False, True])
def test_a_draft_slower_than_the_steps_has_tokens_held_for_its_next_call_and_stays_lossless(pair, sampling):
    """Every draft call answers 20 ms late, far slower than a CPU step: the lane fills, the later
    plain steps' tokens are held and go with the next call (a tree call still ready-only), each token
    once and in order; the output is plain decoding's (float64: exactly)."""
    params = SamplingParams(30, ignore_eos=True, temperature=0.8 if sampling else 0.0, seed=11)
    ref, out, stats, draft = recorded_run(pair, Runs, params, delay_s=0.02)
    assert out == ref
    assert_calls_in_order(draft, out, unsent=len(out))  # (held tokens at the end are never sent)
    assert stats.told_steps < stats.plain_steps  # some plain steps' tokens were held
    trees = [(tokens, bound) for _, tokens, bound in draft.calls if bound != TELL_BOUND]
    assert all(bound.ready_only for _, bound in trees[1:])  # held tokens leave the tree calls ready-only


class CloseThread(Recorder):
    """Records the thread that closes the session."""

    def close(self, session_id):
        self.closed_on = threading.current_thread().name
        super().close(session_id)


@pytest.mark.parametrize("fail_at", [-1, 1])
def test_a_session_s_draft_close_never_runs_on_the_thread_that_steps_it(pair, fail_at):
    """The session's end (or its fallback after a failed call) hands the draft's close to the
    engine's call threads: a close is a round trip (a dead draft's: its deadline), which on the
    stepping thread (the replica's one engine thread) would stall every session. A request run alone
    (`generate`) still returns with its draft session closed."""
    worker = DraftWorker(pair[1].decoder, overlap=True)
    draft = CloseThread(worker, fail_at=fail_at)
    out, _, stats = engine_for(pair, draft).generate(prompt(), SamplingParams(12, ignore_eos=True))
    closed, left = ("close", None) in draft.events, worker.num_sessions  # at once: generate waited for it
    worker.shutdown()
    assert stats.fallback == (fail_at >= 0) and len(out) == 12
    assert closed and left == 0
    assert draft.closed_on.startswith("draft-tell") and draft.closed_on != threading.current_thread().name

