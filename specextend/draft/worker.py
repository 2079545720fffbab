"""The draft side as a worker with an explicit job queue (docs/architecture.md, "Draft side").

One thread owns the draft model and every session's state; nothing else touches them. Jobs:
`Open`, `Step` and `Close` run in arrival order (the foreground), and, with overlap on, the
sessions that have drafting left to do between steps get one background forward each, round
robin, whenever the foreground queue is empty. A background forward is launched (queued on the
device) and finished (its results read) apart: while it runs the thread waits on the job queue,
polling the forward's end, so that an arriving job starts at once; at most one is in flight. The
target reaches the worker directly (in-process, `DraftWorker` is a
DraftBackend whose calls block on their job) or through the gRPC server, which submits jobs and
awaits their futures, so that a call whose deadline passes while queued is cancelled before it
runs.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from specextend.draft.base import (DraftBackend, DraftError, DraftSessionNotFound, DraftSessionParams,
                                   DraftStepOutOfOrder, DraftTree, Retrieval, TreeBound)
from specextend.draft.session import OVERLAP_ROWS, SYNC_DEPTH, DraftSession
from specextend.models.decoder import Decoder

log = logging.getLogger(__name__)

# With overlap, the worker thread runs Python between background forwards while another thread
# (the gRPC loop receiving a step, or an in-process target) waits for the GIL: Python's default
# 5 ms switch interval would add up to 5 ms to a step. Lowered, process-wide, when overlap is on.
SWITCH_INTERVAL_S = 0.0002
# How often the worker looks whether a background forward in flight has finished, while it waits
# for a job (a job wakes it at once): a draft forward takes ~1 ms on an H200.
POLL_S = 0.0001


@dataclass(frozen=True)
class Open:
    session_id: str
    prompt_ids: tuple[int, ...]  # [L]
    params: DraftSessionParams


@dataclass(frozen=True)
class Step:
    session_id: str
    step: int
    accepted_tokens: tuple[int, ...]
    retrieval: Optional[Retrieval] = None
    bound: Optional[TreeBound] = None  # this step's cap on the tree (base.py)


@dataclass(frozen=True)
class Close:
    session_id: str


Job = Union[Open, Step, Close]


@dataclass
class SessionEntry:
    session: DraftSession
    last_step: int = -1  # the last step applied (a retry of it returns last_tree)
    last_tree: Optional[DraftTree] = None


@dataclass(frozen=True)
class WorkerStats:
    sessions: int
    background_forwards: int
    ready_trees: int  # steps answered from the overlap pool
    rebuilds: int = 0  # working-cache rebuilds of the sessions closed so far
    rebuild_s: float = 0.0  # their time, on the draft's device clock
    flight_steps: int = 0  # steps that arrived with a background forward in flight (sessions closed so far)
    flight_waits: int = 0  # ... of them ready steps that waited for it (their new root was in it)


class JobWorker(DraftBackend):
    """One thread running jobs from a queue: foreground jobs in arrival order; between them, while
    `_background()` has work, its slices. Subclasses say what a job does (`_do`)."""

    def __init__(self, name: str = "draft") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Optional[tuple[Job, Future]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the counters read from other threads
        self._open_ids: set[str] = set()
        self._stopped = False
        self._background_forwards = 0
        self._ready_trees = 0
        self._rebuilds, self._rebuild_s = 0, 0.0
        self._flight_steps, self._flight_waits = 0, 0
        self._thread = threading.Thread(target=self._run, name=f"draft-worker-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Future:
        """Queues a job; its future holds the job's result (None, or a DraftTree) or its error. A
        future cancelled before the job starts drops the job. A stopped worker fails it at once."""
        fut: Future = Future()
        with self._lock:
            if not self._stopped:
                self._jobs.put((job, fut))
                return fut
        fut.set_exception(DraftError(f"the draft worker {self.name!r} is stopped"))
        return fut

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> None:
        self.submit(Open(session_id, tuple(prompt_ids), params)).result()

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> DraftTree:
        return self.submit(Step(session_id, step, tuple(accepted_tokens), retrieval, bound)).result()

    def close(self, session_id: str) -> None:
        self.submit(Close(session_id)).result()

    def health(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._open_ids)

    def stats(self) -> WorkerStats:
        with self._lock:
            return WorkerStats(len(self._open_ids), self._background_forwards, self._ready_trees, self._rebuilds,
                               self._rebuild_s, self._flight_steps, self._flight_waits)

    def stop(self) -> None:
        """Stops the worker after the jobs already queued (returns at once); later jobs fail."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._jobs.put(None)

    def shutdown(self) -> None:
        """stop(), then wait for the thread."""
        self.stop()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._setup()
            with torch.inference_mode():
                self._loop()
        finally:  # stopped, or the thread died: no job waits forever
            with self._lock:
                self._stopped = True
            while True:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(DraftError(f"the draft worker {self.name!r} is stopped"))

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued (e.g. its RPC deadline passed)
            try:
                result = self._do(job)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
                fut.set_exception(exc)
                continue
            with self._lock:
                if isinstance(job, Open):
                    self._open_ids.add(job.session_id)
                elif isinstance(job, Close):
                    self._open_ids.discard(job.session_id)
                elif isinstance(result, DraftTree) and result.ready:
                    self._ready_trees += 1
            fut.set_result(result)

    def _next(self) -> Optional[tuple[Job, Future]]:
        """The next foreground job; while there is none, background slices, one in flight at most:
        the next is launched only once the previous has finished."""
        while True:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            if self._in_flight():
                try:
                    return self._jobs.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            if not self._background():
                return self._jobs.get()
            with self._lock:
                self._background_forwards += 1

    def _setup(self) -> None:
        """Runs first on the worker thread."""

    def _background(self) -> bool:
        """Launch one slice of background work; False when there is none."""
        return False

    def _in_flight(self) -> bool:
        """Finishes the slice in flight if it is done; True while it still runs."""
        return False

    def _do(self, job: Job):
        raise NotImplementedError


class SerialDraft(JobWorker):
    """Any DraftBackend behind the job queue (its calls serialized on one thread; no background)."""

    def __init__(self, backend: DraftBackend, name: str = "draft") -> None:
        self.backend = backend
        super().__init__(name)

    def _do(self, job: Job):
        if isinstance(job, Open):
            return self.backend.open(job.session_id, job.prompt_ids, job.params)
        if isinstance(job, Step):
            return self.backend.step(job.session_id, job.step, job.accepted_tokens, job.retrieval, job.bound)
        return self.backend.close(job.session_id)


def as_worker(backend: DraftBackend) -> JobWorker:
    return backend if isinstance(backend, JobWorker) else SerialDraft(backend)


class DraftWorker(JobWorker):
    """The draft model's worker: sessions, idempotent steps, overlapped drafting in the background."""

    def __init__(self, model: Decoder, name: str = "draft", prefill_chunk: int = 2048, overlap: bool = False,
                 overlap_rows: int = OVERLAP_ROWS, sync_depth: int = SYNC_DEPTH):
        self.model = model
        self.sync_depth = sync_depth
        self.prefill_chunk = prefill_chunk
        self.overlap = overlap
        self.overlap_rows = overlap_rows
        if overlap and sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._sessions: dict[str, SessionEntry] = {}  # the worker thread's only
        self._pending: OrderedDict[str, None] = OrderedDict()  # sessions with drafting left to do
        self._flying: Optional[DraftSession] = None  # the session whose background forward is in flight
        super().__init__(name)

    def _setup(self) -> None:
        # the thread's current device is the model's (CUDA graphs and streams are per device)
        if self.model.device.type == "cuda":
            torch.cuda.set_device(self.model.device)

    def _background(self) -> bool:
        """Launch one background forward of the next session with drafting left to do (round
        robin); it stays in flight until `_in_flight` finds it done."""
        while self._pending:
            sid, _ = self._pending.popitem(last=False)
            entry = self._sessions.get(sid)
            if entry is None:
                continue
            try:
                more = entry.session.launch()
            except Exception:  # noqa: BLE001 - drafting ahead is optional: the next step drafts anew
                log.exception("background drafting failed for session %s", sid)
                entry.session.drop_pool()
                continue
            if more:
                self._pending[sid] = None
                self._flying = entry.session
                return True
        return False

    def _in_flight(self) -> bool:
        session = self._flying
        if session is None:
            return False
        if not session.flight_done():
            return True
        self._flying = None
        try:
            session.finish()  # its children join the pool (a closed session's are dropped)
        except Exception:  # noqa: BLE001 - as in _background
            log.exception("finishing a background forward failed")
            session.drop_pool()
        return False

    def _do(self, job: Job):
        if isinstance(job, Open):
            return self._open(job)
        if isinstance(job, Step):
            return self._step(job)
        if isinstance(job, _WarmUp):
            return self._warm_up(job)
        if isinstance(job, _Peek):
            entry = self._sessions.get(job.session_id)
            return entry.session if entry is not None else None
        entry = self._sessions.pop(job.session_id, None)
        self._pending.pop(job.session_id, None)
        if entry is not None:  # the session's signal cost, for the worker's stats
            s = entry.session
            s.drop_pool()  # a forward in flight completes on the device; its result is dropped
            seconds = s.rebuild_timer.seconds()
            with self._lock:
                self._rebuilds += s.refreshes
                self._rebuild_s += seconds
                self._flight_steps += s.flight_steps
                self._flight_waits += s.flight_waits
        return None

    def _open(self, job: Open) -> None:
        if not job.prompt_ids:
            raise DraftError("empty prompt")
        session = DraftSession(self.model, job.prompt_ids, job.params, self.prefill_chunk, overlap=self.overlap,
                               overlap_rows=self.overlap_rows, sync_depth=self.sync_depth)
        self._sessions[job.session_id] = SessionEntry(session)

    def _step(self, job: Step) -> DraftTree:
        entry = self._sessions.get(job.session_id)
        if entry is None:
            raise DraftSessionNotFound(f"unknown draft session {job.session_id!r}")
        if job.step == entry.last_step and entry.last_tree is not None:
            return entry.last_tree  # a retried step: applied once, same tree
        if job.step != entry.last_step + 1:
            raise DraftStepOutOfOrder(f"session {job.session_id!r}: step {job.step} after {entry.last_step}")
        tree = entry.session.step(job.step, job.accepted_tokens, job.retrieval, job.bound)
        entry.last_step, entry.last_tree = job.step, tree
        if self.overlap:
            self._pending[job.session_id] = None
        return tree

    def warm_up(self, params: DraftSessionParams, prompt_len: int = 64) -> int:
        """Before traffic: a throwaway session catches up on plain steps' tokens (the padded
        catch-up forward's shape) and, with overlap, runs the background forwards at every shape
        they take, so their CUDA graphs are captured now, not on a request's path. Returns the
        background forwards run (0 without overlap)."""
        if not self.overlap and not DraftSession.pads_catch_up(self.model):
            return 0  # nothing to capture
        return self.submit(_WarmUp(params, prompt_len)).result()

    def _warm_up(self, job: "_WarmUp") -> int:
        vocab = self.model.args.vocab_size
        prompt = [(17 * i + 3) % vocab for i in range(job.prompt_len)]
        session = DraftSession(self.model, prompt, job.params, self.prefill_chunk, overlap=self.overlap,
                               overlap_rows=self.overlap_rows, sync_depth=self.sync_depth)
        session.step(0, [prompt[-1]], None)
        if session.pads_catch_up(self.model):
            session.step(1, prompt[:job.params.tree.depth + 2], None)  # more than a step accepts: a catch-up
        return session.warm_up() if self.overlap else 0

    # ------------------------------------------------------------------ introspection (tests)
    def session(self, session_id: str) -> Optional[DraftSession]:
        """A session's state, read on the worker (between jobs)."""
        return self.submit(_Peek(session_id)).result()

    def refreshes(self, session_id: str) -> int:
        s = self.session(session_id)
        return s.refreshes if s is not None else 0


@dataclass(frozen=True)
class _Peek:
    session_id: str


@dataclass(frozen=True)
class _WarmUp:
    params: DraftSessionParams
    prompt_len: int
