"""The engine's link to its draft (docs/architecture.md, "Adaptive speculation", "Overlapped
drafting"): whether a draft is worth opening at all, a session's join once the draft's open is done,
the fallback to plain decoding on a DraftError, and a session's close after its last call in flight.
A mixin of Engine: it uses the engine's `config`, `draft` and `target`, and owns the thread pools of
the draft calls no step waits for (`_start_link`)."""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Callable, Generator, Optional

from specextend import governor
from specextend.config import EngineConfig
from specextend.controller import SLOW_DRAFT, TreeController
from specextend.draft.base import DraftBackend, DraftError, DraftTree, TreeBound
from specextend.ladder import PLAIN
from specextend.models.args import ModelArgs
from specextend.open_costs import OpenCosts, open_seconds
from specextend.retrieval import launch_scoring
from specextend.session_calls import DraftCall
from specextend.stats import RequestStats

log = logging.getLogger("specextend.engine")

CLOSE_WAIT_S = 10.0  # Engine.stream waits this long at most for its draft session's close
# A prepare is due this long before the verification it runs beside is expected to end (its answer's
# way back and the draft's assembly of it; docs/architecture.md, "Prepared outcomes")
PREPARE_MARGIN_S = 0.0003
# A tell (a plain step's tokens sent to an overlapping draft, its answer unused) asks for the
# smallest answer the draft can give: it only has to apply the verdict ("Overlapped drafting", told verdicts)
TELL_BOUND = TreeBound(nodes=1, depth=1, ready_only=True)
LANE_BACKLOG = 2  # calls a session's lane holds unanswered; a plain step's tokens then go with the next
OPEN_SLACK = 2  # a deferred open starts this many steps before its expected time says it must


def settled(call: Optional[Future]) -> Generator[DraftCall, object, None]:
    """Waits for a draft call still in flight (a tell), if any, raising its DraftError; returns None
    (the caller's new value for it). Calls of a session go one at a time."""
    if call is not None:
        call.result() if call.done() else (yield DraftCall(future=call))
    return None


class Lane:
    """A session's draft calls that no step waits for (tells, early asks): run one at a time, in the
    order given, on a shared pool, each starting when the one before it has ended, so a step only
    queues its call and goes on to its forward. A call behind a failed one fails with the same
    error, unrun. `tail` is the last call given (what the next waited-for call goes after, and what
    the session's close waits for); `backlog` how many given calls have not ended yet
    (docs/architecture.md, "Overlapped drafting", told verdicts)."""

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self.tail: Optional[Future] = None
        self._open: list[Future] = []  # given, not known to have ended (the engine's thread's only)

    def submit(self, fn: Callable, *args) -> Future:
        out: Future = Future()
        out.submitted = time.perf_counter()  # (its way's times: stats.ask_done)
        before = self.tail

        def run() -> None:
            out.started = time.perf_counter()
            err = before.exception() if before is not None else None
            if err is not None:  # (the session falls back on the first error it meets)
                out.set_exception(err)
                return
            try:
                value = fn(*args)
                out.ended = time.perf_counter()
                out.set_result(value)
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                out.set_exception(e)

        if before is None or before.done():
            self._pool.submit(run)
        else:  # started by the thread that ends `before` (a pool thread), handed to the pool
            before.add_done_callback(lambda _: self._pool.submit(run))
        self.tail = out
        self._open.append(out)
        return out

    def adopt(self, call: Future) -> None:
        """A call begun elsewhere (DraftBackend.start_step) joins the lane as its last call: what
        the next call and the session's close go after."""
        self.tail = call
        self._open.append(call)

    @property
    def idle(self) -> bool:
        """Every call given has ended, none with an error: a call begun now goes after them all."""
        tail = self.tail
        return tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None)

    @property
    def backlog(self) -> int:
        self._open = [f for f in self._open if not f.done()]
        return len(self._open)

    def error(self) -> Optional[BaseException]:
        """The error of the last call given, if it has ended with one (no wait)."""
        return self.tail.exception() if self.tail is not None and self.tail.done() else None


def start_ask(draft: DraftBackend, lane: Lane, sid: str, step: int, tokens, retrieval, bound: TreeBound) -> Future:
    """An early ask, or a plain step's tell (docs/architecture.md, "Overlapped drafting"): begun on
    the caller's thread where the lane is idle and the backend can (DraftBackend.start_step: no
    hand-off to a call thread, whose wake-up was 0.24-0.27 ms of each ask's way on two H200s, nor a
    thread beside the engine's wanting the interpreter lock), else the lane's next call; a retrieval
    selection whose ids are still on their way from the device goes by the lane too (reading them
    here would make the caller wait for the device)."""
    args = (sid, step, tokens, retrieval, bound)
    if lane.idle and getattr(retrieval, "on_host", True):
        call = draft.start_step(*args)
        if call is not None:
            lane.adopt(call)
            return call
    return lane.submit(draft.step, *args)


class RunTells:
    """Tells to an overlapping draft (docs/architecture.md, "Overlapped drafting", told verdicts and
    runs that tell): the tokens committed since the draft's last call go to it as a tell
    (TELL_BOUND: its answer unused), through the session's lane, never waited for; held for the next
    call where LANE_BACKLOG calls are unanswered. A plain step sends `due()` once its forward is
    queued; a run ahead (plain or lookup) calls the object with each step's tokens as the host reads
    them, which tells the tokens read before them, so the draft's pool follows the run and a tree
    after it finds the draft current; the last step's tokens stay pending, as a plain step's do, for
    the next call. `state()` hands the engine back its (step, pending, retrieval, held); `error`: a
    DraftError met in the lane (the engine falls back)."""

    def __init__(self, draft: DraftBackend, lane: Lane, sid: str, step: int, pending: list, retrieval,
                 held: bool, stats: RequestStats) -> None:
        self.draft, self.lane, self.sid, self.stats = draft, lane, sid, stats
        self.step, self.pending, self.retrieval, self.held = step, list(pending), retrieval, held
        self.error: Optional[BaseException] = None

    def due(self) -> Optional[Callable[[], Future]]:
        """The tell of the pending tokens, if one may go now (the caller starts it), its step number
        taken; None: none pending, an error met, or held."""
        if self.error is not None or not self.pending:
            return None
        err = self.lane.error()
        if isinstance(err, DraftError):
            self.error = err
            return None
        if self.lane.backlog >= LANE_BACKLOG:  # they go with the next call
            self.held = True
            return None
        send = partial(start_ask, self.draft, self.lane, self.sid, self.step, self.pending, self.retrieval, TELL_BOUND)
        self.step, self.pending, self.retrieval, self.held = self.step + 1, [], None, False
        self.stats.told_steps += 1
        return send

    def __call__(self, tokens: list[int]) -> None:
        retrieval = self.retrieval
        send = self.due()
        if send is not None:
            launch_scoring(retrieval)  # (before a call that may run on another thread)
            send()
        self.pending = self.pending + list(tokens)

    def state(self) -> tuple:
        return self.step, self.pending, self.retrieval, self.held


def ask_ahead(draft: DraftBackend, lane: Lane, ctl: TreeController, lookup, sessions: int, sid: str, step: int,
              pending: list, retrieval) -> tuple:
    """After a plain or unready step, with early asks (docs/architecture.md, "Adaptive speculation",
    asks ahead of a run): the next step's rung, chosen now that the step's tokens are known (with
    the chain a plain step would verify then: `lookup`'s peek, None without one); a tree's ask
    leaves at once with them, as a tree step's verdict's does, so a run's first tree is asked early
    too. -> (rung, the ask or None, step, pending, retrieval), as the engine carries them on."""
    ctl.see_chain(lookup)
    rung = ctl.choose_noted(sessions)
    if rung.plain:
        return rung, None, step, pending, retrieval
    launch_scoring(retrieval)  # (before a call that may run on another thread)
    asked = start_ask(draft, lane, sid, step, pending, retrieval, replace(ctl.top.bound, ready_only=True))
    return rung, asked, step + 1, [], None


def send_prepare(draft: DraftBackend, lane: Optional[Lane], sid: str, step: int, tokens, retrieval,
                 verify_ema: float, late_ema: float, late: list[float]) -> tuple[Future, float]:
    """A prepare sent beside a tree's verification (docs/architecture.md, "Prepared outcomes"), the
    session's lane idle (the step's tree came after its calls): due PREPARE_MARGIN_S before the
    verification is expected to end (`verify_ema`), sooner by `late_ema`, into which the lateness of
    answers since (`late`, emptied) is folded first: a late one at once, in time ones slowly later.
    With early asks (`lane`) the next call goes after it. -> (the prepare's Future, late_ema); a
    DraftError is the Future's, met where the next step would have met it."""
    while late:
        lt = late.pop()
        late_ema = late_ema + lt if lt > 0 else 0.7 * late_ema
    try:
        prepared = draft.prepare(sid, step, tokens, retrieval, max(0.0, verify_ema - PREPARE_MARGIN_S - late_ema))
    except DraftError as e:
        prepared = Future()
        prepared.set_exception(e)
    if lane is not None:
        lane.adopt(prepared)
    return prepared, late_ema


def prepared_tree(prepared: Optional[Future], verdict, step: int, late: list[float]) -> Optional[DraftTree]:
    """At a verdict, with early asks (docs/architecture.md, "Prepared outcomes"): the tree a prepare's
    answer holds for `verdict` (tokens) as step `step`, if the answer is in (a hit: no call; else a
    miss, whose ask goes after the prepare in the lane and meets its error, if any). An answer not
    in yet adds to `late`, when it comes, how long after the verdict it came (the next prepares fall
    due that much sooner); one in time adds 0."""
    if prepared is None or (prepared.done() and prepared.exception() is not None):
        return None
    if not prepared.done():
        t = time.perf_counter()
        prepared.add_done_callback(lambda _: late.append(time.perf_counter() - t))
        return None
    late.append(0.0)
    outs = prepared.result()
    return outs.get(verdict) if outs.step == step else None


def draft_weight_ratio(target: ModelArgs, draft: Optional[ModelArgs]) -> float:
    """The weights a draft forward multiplies by over the target's (0.0: the draft's shape unknown)."""
    return draft.decode_weights() / target.decode_weights() if draft is not None else 0.0


def never_pays(config: EngineConfig, ratio: float) -> bool:
    """A draft `ratio` times the target's weights costs at least that many target forwards a tree
    level: from SLOW_DRAFT up no tree can beat a plain step, whatever it accepts, and the adaptive
    policy does not open it (the fixed policy drafts every step anyway)."""
    return config.uses_draft and config.tree_policy == "adaptive" and ratio >= SLOW_DRAFT


class DraftLink:
    config: EngineConfig
    target: object  # LoadedModel
    draft: object  # DraftBackend
    # the draft's open timed against the target's prefill seeds the adaptive policy's prior (tests
    # turn it off, conftest.py: on a loaded host the two prefills' ratio is the host's, not the pair's)
    prior_from_prefill = True
    # a session that can take no tree before its next probe opens the draft only some steps before it
    # (docs/architecture.md, "Adaptive speculation", *Deferred open*), from the opens timed at lengths near its prompt's
    defer_opens = True
    open_costs: OpenCosts  # (_start_link)

    def _start_link(self, draft_args: Optional[ModelArgs]) -> None:
        """Whether the draft is opened at all: a draft that can never pay is not (docs/architecture.md,
        "Adaptive speculation"); the draft calls' threads: the opens (a session's prefill on the
        draft), and the calls of every session's lane and its close; the sessions whose draft close
        has not run yet."""
        self.draft_weight_ratio = draft_weight_ratio(self.target.args, draft_args)
        self.open_costs = OpenCosts()
        self.draft_never_pays = never_pays(self.config, self.draft_weight_ratio)
        if self.draft_never_pays:
            log.warning("the draft multiplies by %.1fx the target's weights a forward: no draft tree can pay, "
                        "so requests decode without it (context lookup %s; tree_policy=fixed drafts anyway)",
                        self.draft_weight_ratio, "on" if self.config.lookup_tokens else "off")
        self._openers: Executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="draft-open")
        self._tells: Executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="draft-tell")
        self._unclosed: dict[str, threading.Event] = {}  # set once the close has run (or the open failed)

    def _open_draft(self, sid: str, prompt_ids, params) -> Future:
        """Starts the draft's open (its prefill) of session `sid` on the opener threads; the session
        counts as unclosed until its close has run (`wait_closed`). -> the open's Future (seconds)."""
        self._unclosed[sid] = threading.Event()
        opening = self._openers.submit(open_seconds, self.draft.open, sid, list(prompt_ids), params)
        opening.prompt_tokens = len(prompt_ids)  # (the open timed by its length: _join)
        return opening

    def defers_open(self, ctl: TreeController, prompt_tokens: int, held: bool = False) -> bool:
        """Whether this session's draft open waits (`open_due`): its draft shares the target's device
        (no overlap: with its own device an open costs the target nothing), and either the batch it
        joins is held to plain steps (`held`: held_plain), or an earlier open timed what one costs and
        the policy can take no tree for more steps than the open is expected to take
        (TreeController.first_tree_in: a primed session that skips the warm-up tree, before its next
        probe). Deferred, a session that ends before its probe never opens the draft: no prefill of its
        prompt beside the target's (which it slows), no draft cache held. Its choices are the same: the
        open is done, or nearly, when the probe is due, which then waits for the join."""
        if not (self.defer_opens and self.config.tree_policy == "adaptive" and not self.config.overlap):
            return False
        open_s = self.open_costs.seconds(prompt_tokens)  # (None: no open timed near this prompt's length)
        if open_s is not None:
            ctl.price_open(open_s)  # (the probe that opens it costs the open too)
        if held:
            return True
        if open_s is None:
            return False
        if ctl.first_tree_in() > self._open_lead(ctl, prompt_tokens):
            return True
        ctl.no_open()  # (it opens now)
        return False

    @staticmethod
    def held_plain(ctl: TreeController, load) -> bool:
        """Whether the batch's governor holds the session to plain steps now (governor.py): it takes no
        tree before the hold ends (a hold to trees opens the drafts at once: `open_due`'s `now`)."""
        return ctl.governed and load is not None and load.held == governor.PLAIN

    def open_due(self, ctl: TreeController, prompt_tokens: int, tokens_left: int, now: bool = False) -> bool:
        """A deferred open starts now: the session's first possible tree is within the open's lead,
        and the probe would come before the request's end (`tokens_left` to generate: at least one
        a step): at its due step or, where the open takes longer, once the open has joined. An open
        for a probe that a later request will take would only be closed again, unused (the tiny
        pair on a CPU opened its draft ~1-2 steps before most requests' ends, ~24 ms of draft
        prefill each, where the probe was due but the open's lead was longer than the steps left).
        `now`: a tree is wanted at once (the batch's governor holds the session to trees, governor.py):
        due unless the request would end within the open's lead."""
        first, lead = (0 if now else ctl.first_tree_in()), self._open_lead(ctl, prompt_tokens)
        return first <= lead and max(first, lead) < tokens_left

    def open_prior(self, prompt_tokens: int, own_prefill_s: float) -> float:
        """What a deferred open of this prompt is expected to cost (Load.open_s, the batch's governor):
        open_costs.OpenCosts where an open near its length was timed, else the draft weights' share of the
        session's own target prefill, `own_prefill_s` (session_calls.OwnShare: not the wall time, which a
        batch's other chunks and steps stretch; docs/architecture.md, "Adaptive speculation", *The batch's check*)."""
        return self.open_costs.seconds(prompt_tokens) or self.draft_weight_ratio * own_prefill_s

    def _open_lead(self, ctl: TreeController, prompt_tokens: int) -> int:
        """Steps an open is expected to take: its expected seconds (open_costs.OpenCosts: 0 where no
        open was timed near this prompt's length) over a plain step's predicted seconds, and
        OPEN_SLACK more."""
        expected = self.open_costs.seconds(prompt_tokens) or 0.0
        return math.ceil(expected / max(ctl.step_seconds(PLAIN), 1e-6)) + OPEN_SLACK

    def wait_closed(self, sid: str, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Waits (up to `timeout_s`) for session `sid`'s draft close; True once closed or never opened."""
        ev = self._unclosed.get(sid)
        return ev is None or ev.wait(timeout_s)

    def _join(self, opening: Future, ctl: TreeController, target_prefill_s: float, stats: RequestStats,
              sid: str) -> Generator[DraftCall, object, bool]:
        """The draft's open, finished (or waited for): whether the session speculates from now on (a
        failed open: plain decoding). Its time against the target's prefill of the same prompt is the
        controller's prior for what drafting costs (docs/architecture.md, "Adaptive speculation")."""
        try:
            open_s = opening.result() if opening.done() else (yield DraftCall(future=opening))
        except DraftError as e:
            return self._fall_back(stats, sid, e)
        stats.draft_open_s, stats.target_prefill_s = open_s, target_prefill_s
        ctl.no_open()
        self.open_costs.record(getattr(opening, "prompt_tokens", 1), open_s)  # (a deferred open's lead)
        if self.prior_from_prefill:
            ctl.seed_draft(open_s / max(target_prefill_s, 1e-9))
        return True

    def _fall_back(self, stats: RequestStats, sid: str, err: Exception) -> bool:
        log.warning("draft failed for session %s (%s); continuing with plain decoding", sid, err)
        stats.fallback = True
        self._close_soon(sid)
        return False

    def _release(self, sid: str, lane: Lane, feed, opening: Optional[Future]) -> None:
        """A session's end: its draft session closes once its open has finished (now, or later if
        still running), and after its last call in flight (a step must not reach the draft after
        its session's close); `feed`: with snapshots, whose pending call is that last one."""
        told = lane.tail
        if feed is not None and feed.pending() is not None:
            told = feed.pending()
        if opening is not None:
            opening.add_done_callback(lambda done: self._close_after(sid, told, done))

    def _close_after(self, sid: str, told: Optional[Future], opening: Future) -> None:
        if opening.exception() is not None:  # no session was opened
            self._closed(sid)
        elif told is None:
            self._close_soon(sid)
        else:
            told.add_done_callback(lambda _: self._close_soon(sid))

    def _close_soon(self, sid: str) -> None:
        """The draft session's close, on the call threads: never on the thread that steps sessions (a
        done future runs its callbacks on the caller's thread, the engine's, where the close's round
        trip, or a dead draft's deadline, would stall every session's steps). `wait_closed` waits for it."""
        self._tells.submit(self._close_draft, sid)

    def _close_draft(self, sid: str) -> None:
        try:
            self.draft.close(sid)
        except Exception as e:  # closing is best-effort; a dead draft has nothing left to free
            log.info("closing draft session %s failed: %s", sid, e)
        finally:
            self._closed(sid)

    def _closed(self, sid: str) -> None:
        ev = self._unclosed.pop(sid, None)
        if ev is not None:
            ev.set()
