"""The batched driver of the engine's session coroutines (docs/architecture.md, "Batched steps").

A session (Engine.session) yields what it needs: a `ForwardCall` (a target forward over its own
KV cache), a `DraftCall` (a call to the draft backend, which may wait on another process or
GPU) or a step event for its client (session_calls.py, with `drive_alone`, which runs one session
in place). `Batcher` runs many
on one thread in rounds: it advances every session that can move until each waits on a forward or
a draft call, then issues the round's draft calls together on a small pool (the draft side queues
them, and its worker runs queued steps of different sessions as one batch), and
runs the collected forwards as one batched target forward (models/batch.forward_batch, up to
`max_batch` calls each). A session that waits on a draft call does not hold the others' forward
back, except that a round waits for the draft steps it issued itself (milliseconds) so that the
sessions' verifications meet in one forward; a draft session still opening (its prefill) is
never waited on, and a round carrying a prompt chunk issues that forward before it waits (chunk
first). Each session's `Load` hears of the forwards that carried its calls (how many
sessions shared them, their rows and duration) and of the round's waits it shared
(round_charges.py), for its adaptive policy (controller.py); with a
`Governor` (governor.py) the batch measures its rounds and may hold its sessions to plain steps
or to trees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Generator, Optional

import torch

from specextend.batch_loads import BatchLoads
from specextend.governor import FREE, OPENING, TREES, Governor
from specextend.kv_pool import KVPool
from specextend.models.batch import ForwardCall, forward_batch
from specextend.models.decoder import Decoder
from specextend.round_charges import charge, charge_held, tell_loads
from specextend.round_log import RoundLog
from specextend.session_calls import DraftCall, Load
from specextend.timing import Stopwatch

log = logging.getLogger(__name__)


def _called(fn: Callable[[], Any]) -> Future:
    """fn's result (or exception) in a completed future, called here."""
    f: Future = Future()
    try:
        f.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - delivered to the session like a pool call's
        f.set_exception(exc)
    return f


Sink = Callable[[Any], bool]  # receives an event, None (the session ended) or an exception; False pauses


class _Entry:
    """A session in the batcher: what goes into it next, and what it waits on."""

    __slots__ = ("co", "sink", "load", "send", "exc", "call", "draft_fn", "future", "opening_call", "paused",
                 "resumed", "stopped", "emitted")

    def __init__(self, co: Generator, sink: Sink, load: Optional[Load]) -> None:
        self.co, self.sink, self.load = co, sink, load
        self.send: Any = None
        self.exc: Optional[BaseException] = None
        self.call: Optional[ForwardCall] = None  # waiting on this round's forward
        self.draft_fn: Optional[Callable[[], Any]] = None  # a draft step, issued with the round's others
        self.future: Optional[Future] = None  # waiting on a draft call
        self.opening_call = False  # ... on the draft session's opening (not waited for by a round)
        self.paused = False  # its client lags (the sink said so): not advanced until resumed
        self.resumed = False  # a resume that arrived before the pause it answers
        self.stopped = False
        self.emitted = 0  # tokens delivered to its sink


SPANS_KEPT = 1024  # forwards whose durations a Batcher keeps (benchmarks: the device's busy time)
OPEN_WAIT_S = 10.0  # (wait_opens) the longest a round waits for draft opens; the rest then run beside


class Batcher(BatchLoads):
    """Runs sessions in rounds on one thread (`run`, or `run_round` from a test), every round one
    batched target forward. `add`, `resume` and `stop` may be called from any thread."""

    def __init__(self, model: Decoder, max_batch: int = 8, draft_threads: int = 8, forward=forward_batch,
                 on_forward: Optional[Callable[[int], None]] = None, max_tokens: Optional[int] = None,
                 governor: Optional[Governor] = None, on_held: Optional[Callable[[str], None]] = None,
                 wait_opens: bool = False) -> None:
        self.model = model
        # a round held to trees while drafts open first waits for the opens: a draft in this process, on this
        # device, whose opens beside the rounds starve (docs/architecture.md, "Adaptive speculation", *The
        # batch's check*)
        self.wait_opens = wait_opens
        # the batch's check on its sessions' choices (governor.py): rounds held to plain steps where
        # those decode more than the sessions' own choices (None: the sessions decide alone)
        self.governor = governor
        self._on_held = on_held  # told of each round the governor holds, and to what (the replica's metrics)
        self.held_rounds: Counter = Counter()  # rounds held, by regime (governor.PLAIN, TREES)
        self._round_tokens = 0  # tokens the sessions emitted this round (the governor's measure)
        self._round_chunks = 0  # prompt chunks this round's forwards carried
        self._last_set: frozenset = frozenset()  # the sessions of the round before
        self.max_tokens = max_tokens  # rows a round's forwards carry, prompt chunks within it (None: any)
        self.held_chunks = 0  # prompt chunks a round held for a later one (the budget was spent)
        self._forward = forward  # forward_batch (its signature; tests pass a fake)
        self._on_forward = on_forward  # told each forward's number of calls (the replica's metrics)
        self.max_batch = max_batch
        # on the CPU the sessions' target caches are slots of one pool, their steps one attention call a
        # layer (kv_pool.py); a GPU's batched forwards run through captured graphs instead
        cpu = model is not None and model.device.type == "cpu"  # (a test's fake forward has no model)
        self.kv_pool = KVPool(model.args, model.dtype, model.device, max_batch) if max_batch > 1 and cpu else None
        self._pool = ThreadPoolExecutor(draft_threads, thread_name_prefix="draft-call")
        self._sessions: list[_Entry] = []
        self._lock = threading.Condition()
        self._incoming: list[_Entry] = []
        self._closing = False
        self.forwards = 0  # batched forwards run
        self.calls = 0  # forward calls they carried
        self.max_calls = 0  # the most calls one forward carried
        self.spans: deque = deque(maxlen=SPANS_KEPT)  # the latest forwards' durations (timing.Span)
        self.round_log = RoundLog()  # each round as a JSON line, where SPECEXTEND_ROUND_LOG names a folder

    # ------------------------------------------------------------------ any thread
    def new_load(self) -> Load:
        """A session's Load for this batcher (Engine.session's `load`, then `add`'s): it lends the
        session a slot of the batcher's pool for its target cache, where there is one."""
        return Load(kv_pool=self.kv_pool)

    def add(self, co: Generator, sink: Sink, load: Optional[Load] = None) -> _Entry:
        """`load`: the session's (Engine.session's `load`), told of each forward that carries its calls."""
        entry = _Entry(co, sink, load)
        with self._lock:
            self._incoming.append(entry)
            self._lock.notify()
        return entry

    def resume(self, entry: _Entry) -> None:
        """Answers one pause (one sink call that returned False), whether or not it is in force yet."""
        with self._lock:
            if entry.paused:
                entry.paused = False
            else:
                entry.resumed = True
            self._lock.notify()

    def stop(self, entry: _Entry) -> None:
        """The session is closed on the batcher's thread at the next round (its `finally` runs there)."""
        with self._lock:
            entry.stopped = True
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()

    # ------------------------------------------------------------------ the batcher's thread
    def run(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not self._has_work():
                    self._lock.wait(timeout=self._poll_s())
                if self._closing:
                    break
            try:
                self.run_round()
            except Exception as exc:  # noqa: BLE001 - a round's own failure: its sessions end, the thread goes on
                log.exception("a batcher round failed; its sessions end with the error")
                self._fail_all(exc)
        for e in self._sessions + self._incoming:
            e.co.close()
        self.round_log.close()

    def _fail_all(self, exc: Exception) -> None:
        """Every admitted session ends with `exc` (its client gets the error) and is closed (its
        `finally` frees its draft session); sessions added since the round wait for the next."""
        for e in list(self._sessions):
            self._sessions.remove(e)
            self._deliver(e, exc)
            e.co.close()

    def _poll_s(self) -> Optional[float]:
        """Wake up for draft futures (their callbacks notify too; this bounds a missed one)."""
        return 0.05 if any(e.future is not None for e in self._sessions) else None

    def _has_work(self) -> bool:
        return bool(self._incoming) or any(
            e.stopped or (not e.paused and (e.future is None or e.future.done())) for e in self._sessions)

    @torch.inference_mode()
    def run_round(self) -> None:
        with self._lock:
            self._sessions += self._incoming
            self._incoming = []
        self.round_log.begin(len(self._sessions), None if self.model is None else self.model.device)
        held = self.held_chunks
        members = frozenset(map(id, self._sessions))
        steady, self._last_set = members == self._last_set, members
        self._round_tokens = self._round_chunks = 0
        hold = None
        if self.governor is not None:
            # (a batch's first round at a new size: held as its next ones will be)
            regime = self.governor.regime(len(self._sessions), self.life())
            hold = None if regime == FREE else regime
            if hold == TREES and self.opening():  # (every session plain until every draft is open: no mixed round)
                hold = OPENING
                if self.wait_opens:
                    t0 = time.perf_counter()
                    wait(self._opens(), timeout=OPEN_WAIT_S)  # (the lock released: the opens run alone)
                    self.round_log.opens_waited(time.perf_counter() - t0)
            self.round_log.regime(hold or FREE)
            for e in self._sessions:
                if e.load is not None:
                    e.load.held = hold
            if hold is not None:
                self.held_rounds[regime] += 1
                if self._on_held is not None:
                    self._on_held(regime)
        for e in [e for e in self._sessions if e.stopped]:
            self._finish(e, close=True)
        t_advance = time.perf_counter()
        for e in list(self._sessions):
            self._advance(e)
        self.round_log.advanced(t_advance)
        # the round's draft steps leave together, once every session has had its turn: they reach the
        # draft's queue within microseconds of each other, and the draft worker runs them as one batch
        issued = [e for e in self._sessions if e.draft_fn is not None]
        # a waiting prompt chunk does not wait for the draft: the round's forwards go first and the
        # draft steps' verifications follow in a forward of their own (docs/architecture.md, "Batched steps")
        chunk_first = bool(issued) and any(e.call is not None and e.call.prompt for e in self._sessions)
        if len(issued) == 1 and not chunk_first:  # one draft step: called on this thread, which would wait
            e = issued[0]  # for it anyway (two thread hand-offs fewer on the step's critical path)
            fn, e.draft_fn = e.draft_fn, None
            t0 = time.perf_counter()
            e.future = _called(fn)
            waited = time.perf_counter() - t0
            self._charge(self._sessions, [e], waited)
            self.round_log.drafts(1, waited)
            self._advance(e)
        else:
            for e in issued:
                fn, e.draft_fn = e.draft_fn, None
                e.future = self._pool.submit(fn)
                e.future.add_done_callback(self._notify)
        held_back: list[_Entry] = []  # draft steps that ended while a chunk-first forward was issued
        if chunk_first:
            t0 = time.perf_counter()
            self._run_forwards([e for e in self._sessions if e.call is not None])
            held_back = self._charge_held(issued, t0)
        step_futures = [e for e in self._sessions if e.future is not None and not e.future.done() and e.call is None]
        # the draft steps issued this round: wait for them so their verifications join this round
        askers = [e for e in step_futures if not e.opening_call]
        if askers or chunk_first:
            t0 = time.perf_counter()
            wait([e.future for e in askers])
            waited = time.perf_counter() - t0
            if askers:  # (a chunk-first round's steps may all have ended within its forward)
                self._charge(self._sessions, askers, waited)
            for e in held_back:  # (their wait for the others' steps is not their draft's price either)
                e.load.shared_s += waited
            self.round_log.drafts(len(issued), waited)
            for e in [e for e in self._sessions if e.future is not None and e.future.done() and e.call is None]:
                self._advance(e)
        # (after a chunk-first forward, the prompt chunks it held wait for the next round)
        self._run_forwards([e for e in self._sessions if e.call is not None and not (chunk_first and e.call.prompt)])
        self.round_log.write(self.held_chunks - held, self._round_tokens,
                             self.openings() if self.round_log.on else 0)
        if self.governor is not None:
            # (a session whose draft still opens steps plainly whatever the regime: not a steady round)
            self.governor.round_end(len(members), self._round_tokens,
                                    steady and not self._round_chunks and not self.opening(), life=self.life(),
                                    opening=hold == OPENING, opens_s=self.opens_s())

    def _run_forwards(self, ready: list[_Entry]) -> None:
        """The calls of `ready` within the round's budget, as batched forwards of up to `max_batch`
        calls; each session's result (or exception) is what it is sent next."""
        calls = self._within_budget(ready)
        for lo in range(0, len(calls), self.max_batch):
            group = calls[lo:lo + self.max_batch]
            watch = Stopwatch(group[0].call.ids)
            t0 = time.perf_counter()
            try:
                results = self._forward(self.model, [e.call for e in group])
            except Exception as exc:  # noqa: BLE001 - e.g. a full cache: each session gets it
                results = [exc] * len(group)
            span = watch.stop()
            chunks = sum(bool(e.call.prompt) for e in group)
            self._round_chunks += chunks
            if self.round_log.on:
                self.round_log.forward(len(group), sum(e.call.ids.shape[0] for e in group), chunks,
                                       time.perf_counter() - t0)
            self._tell_loads(group, span)
            self.spans.append(span)
            if self._on_forward is not None:
                self._on_forward(len(group))
            self.forwards += 1
            self.calls += len(group)
            self.max_calls = max(self.max_calls, len(group))
            for e, r in zip(group, results):
                e.call = None
                if isinstance(r, Exception):
                    e.exc = r
                else:
                    e.send = r

    def _within_budget(self, calls: list[_Entry]) -> list[_Entry]:
        """The calls this round carries: every step's (decode, verification, a chain), then prompt
        chunks in admission order while the round's rows stay within `max_tokens`, at least one
        chunk a round; the others keep their call for a later round, so that a long prompt's
        prefill does not stretch the steps of the sessions decoding beside it (docs/architecture.md,
        "Batched steps")."""
        if self.max_tokens is None or not any(e.call.prompt for e in calls):
            return calls
        rows = sum(e.call.ids.shape[0] for e in calls if not e.call.prompt)
        out, chunks = [], 0
        for e in calls:
            n = e.call.ids.shape[0]
            if e.call.prompt and chunks and rows + n > self.max_tokens:
                self.held_chunks += 1
                continue
            out.append(e)
            if e.call.prompt:
                rows, chunks = rows + n, chunks + 1
        return out

    # what a round tells its sessions' Loads (round_charges.py); tests call and patch them here
    _charge, _charge_held, _tell_loads = staticmethod(charge), staticmethod(charge_held), staticmethod(tell_loads)

    def _advance(self, e: _Entry) -> None:
        """Moves a session until it waits on a forward or a draft call, pauses, or ends."""
        while not e.paused and e.call is None and e.draft_fn is None and e in self._sessions:
            if e.future is not None:
                if not e.future.done():
                    return
                f, e.future = e.future, None
                try:
                    e.send = f.result()
                except Exception as exc:  # noqa: BLE001 - thrown into the session
                    e.exc = exc
            try:
                exc, e.exc = e.exc, None
                item = e.co.throw(exc) if exc is not None else e.co.send(e.send)
            except StopIteration:
                self._finish(e, end=None)
                return
            except Exception as exc:  # noqa: BLE001 - the session failed: its client gets the error
                self._finish(e, end=exc)
                return
            e.send = None
            if isinstance(item, ForwardCall):
                e.call = item
            elif isinstance(item, DraftCall):
                e.opening_call = item.future is not None
                if not e.opening_call:
                    e.draft_fn = item.fn  # issued by run_round with the round's other draft steps
                    return
                e.future = item.future
                e.future.add_done_callback(self._notify)
            elif not self._deliver(e, item):
                if e not in self._sessions:
                    return
                with self._lock:
                    e.paused, e.resumed = not e.resumed, False

    def _notify(self, f: Future) -> None:
        f.done_at = time.perf_counter()  # (_charge_held)
        with self._lock:
            self._lock.notify()

    def _deliver(self, e: _Entry, item: Any) -> bool:
        """The sink's answer (False: pause); a sink that fails (its consumer is gone) stops the session."""
        n = len(getattr(item, "token_ids", None) or ())
        self._round_tokens += n
        e.emitted += n
        try:
            return e.sink(item)
        except Exception:  # noqa: BLE001 - never let one consumer take the engine thread down
            log.exception("a session's consumer failed; closing the session")
            if e in self._sessions:
                self._finish(e, close=True)
            return False

    def _finish(self, e: _Entry, end: Any = None, close: bool = False) -> None:
        self._sessions.remove(e)
        if close:
            e.co.close()
        else:
            self._deliver(e, end)
