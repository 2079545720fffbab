"""A job queue on one thread (docs/architecture.md, "Draft side"): the draft side's calls as jobs.

`JobWorker` runs `Open`, `Step` and `Close` jobs in arrival order (the foreground) on its own
thread; `Step` jobs of different sessions queued together run as one batch when the subclass
batches (`max_batch` > 1: DraftWorker, worker.py); between jobs, while the subclass has
background work, its slices. Callers get futures; a job whose future is cancelled while queued
never runs. `SerialDraft` puts any DraftBackend behind such a queue.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from typing import Optional, Sequence

import torch

from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.draft.batch import BatchCounts
from specextend.draft.job_types import Close, Job, Open, Prepare, Step, WorkerStats  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

# How often the worker looks whether a background forward in flight has finished, while it waits
# for a job (a job wakes it at once): a draft forward takes ~1 ms on an H200.
POLL_S = 0.0001
# How long the worker lets a transport that asked (a step channel) send an answer before the thread's
# next work (a ready step's K/V moves, a background launch) competes with it for the GIL
HANDOVER_WAIT_S = 0.002
RECENT_S = 0.25  # a session that stepped this recently is expected to step again soon


def with_times(tree, fut: Future, arrival: Optional[float] = None):
    """`tree` (a DraftTree or a prepare's Outcomes: its job finished, `fut` its future) with the
    draft side's time on the step:
    from `arrival` (perf_counter when the step reached the draft; default: when it was queued) to
    now, and how much of it the step waited for the worker's thread (docs/architecture.md,
    "Wire protocol": the target's wait minus it is the transport)."""
    now = time.perf_counter()
    arrival = getattr(fut, "submitted", now) if arrival is None else arrival
    started = getattr(fut, "started", arrival)
    return replace(tree, server_s=max(0.0, now - arrival), queued_s=max(0.0, started - arrival))


class JobWorker(DraftBackend):
    """One thread running jobs from a queue: foreground jobs in arrival order; between them, while
    `_background()` has work, its slices. Subclasses say what a job does (`_do`)."""

    batches_steps = False  # Step jobs go through _do_steps, batched up to max_batch (DraftWorker)
    max_batch = 1
    gather_s = 0.0  # how long a batch may wait for the steps of sessions that stepped recently
    answer_first = True  # a batch's answers are handed over before its _after_steps work (False: the twin)
    handover_wait_s = HANDOVER_WAIT_S  # 0: the thread goes on at once after completing a job

    def __init__(self, name: str = "draft") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Optional[tuple[Job, Future]]] = queue.SimpleQueue()
        self._deferred: deque[Optional[tuple[Job, Future]]] = deque()  # taken from the queue, not yet run
        self._step_batches = self._batched_steps = 0  # (under _lock)
        self._step_forwards = self._step_calls = 0  # the steps' forwards and the calls they carried
        self._recent: dict[str, float] = {}  # session -> when it last stepped (the worker thread's)
        self._batch_s = 0.0  # how long the last batch of steps took
        self._lock = threading.Lock()  # guards the counters read from other threads
        self._open_ids: set[str] = set()
        self._stopped = False
        self._background_forwards = 0
        self._ready_trees = 0
        self._rebuilds, self._rebuild_s = 0, 0.0
        self._flight_steps, self._flight_waits = 0, 0
        self._chained_nodes, self._dropped_levels = 0, 0
        self._times = dict(foreground_s=0.0, background_host_s=0.0, poll_s=0.0, idle_s=0.0)  # the thread's
        self._thread = threading.Thread(target=self._run, name=f"draft-worker-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job, handover: Optional[threading.Event] = None) -> Future:
        """Queues a job; its future holds the job's result (None, or a DraftTree) or its error. A
        future cancelled before the job starts drops the job. A stopped worker fails it at once.
        `handover`: set by the caller once it has sent the answer on (the thread waits for it, up to
        `handover_wait_s`, before its next work)."""
        fut: Future = Future()
        fut.submitted = time.perf_counter()  # with_times: the step's queueing and draft time
        fut.handover = handover
        with self._lock:
            if not self._stopped:
                self._jobs.put((job, fut))
                return fut
        fut.set_exception(DraftError(f"the draft worker {self.name!r} is stopped"))
        return fut

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> Optional[float]:
        fut = self.submit(Open(session_id, tuple(prompt_ids), params))
        fut.result()
        return getattr(fut, "ran_s", None)  # (_answer: from the job's start, not its queueing)

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> DraftTree:
        fut = self.submit(Step(session_id, step, tuple(accepted_tokens), retrieval, bound))
        return with_times(fut.result(), fut)

    def close(self, session_id: str) -> None:
        self.submit(Close(session_id)).result()

    def start_step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
                   retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> Future:
        """The step queued on the worker now; its tree (with_times) in the future returned."""
        job = self.submit(Step(session_id, step, tuple(accepted_tokens), retrieval, bound))
        out: Future = Future()
        out.submitted = out.started = job.submitted

        def answered(f: Future) -> None:  # (on the worker's thread, as it answers)
            out.ended = time.perf_counter()
            try:
                out.set_result(with_times(f.result(), f))
            except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                out.set_exception(exc)
        job.add_done_callback(answered)
        return out

    def prepare(self, session_id: str, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
                due_s: float) -> Future:
        return self.submit(Prepare(session_id, step, tuple(accepted_tokens), retrieval, due_s))

    def health(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._open_ids)

    def stats(self) -> WorkerStats:
        with self._lock:
            return WorkerStats(len(self._open_ids), self._background_forwards, self._ready_trees, self._rebuilds,
                               self._rebuild_s, self._flight_steps, self._flight_waits, self._step_batches,
                               self._batched_steps, self._step_forwards, self._step_calls,
                               self._chained_nodes, self._dropped_levels, **self._times)

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
                    item = self._deferred.popleft() if self._deferred else self._jobs.get_nowait()
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
            fut.started = time.perf_counter()
            with self._timed("foreground_s"):
                try:
                    self._run_job(job, fut)
                except Exception as exc:  # noqa: BLE001 - a bug outside a job's own handling fails that
                    log.exception("draft worker %r: job %s failed", self.name, type(job).__name__)
                    if not fut.done():  # job, not the thread: every later caller would wait forever
                        fut.set_exception(exc)

    @contextlib.contextmanager
    def _timed(self, key: str):
        """Adds the block's wall time to the thread's time split (WorkerStats)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            with self._lock:
                self._times[key] += dt

    def _run_job(self, job: Job, fut: Future) -> None:
        """One foreground job (a Step gathers the steps queued behind it into a batch)."""
        if isinstance(job, (Step, Close, Prepare)):
            self._answer_prepared(job.session_id)  # a session's prepare is answered before its next job
        if isinstance(job, Prepare):
            self._start_prepare(job, fut)
            return
        if isinstance(job, Step) and self.batches_steps:
            batch = self._gather(job, fut)
            counts = BatchCounts()
            t = time.monotonic()
            outcomes = self._do_steps([j for j, _ in batch], counts)
            self._batch_s = time.monotonic() - t
            with self._lock:
                self._step_batches += 1
                self._batched_steps += len(batch)
                self._step_forwards += counts.forwards
                self._step_calls += counts.calls
            jobs = [j for j, _ in batch]
            if not self.answer_first:
                self._after_steps(jobs)
            for (j, f), outcome in zip(batch, outcomes):
                self._complete(j, f, outcome, handover=False)
            self._handed_over([f for _, f in batch])
            if self.answer_first:
                self._after_steps(jobs)
            return
        try:
            result = self._do(job)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
            fut.set_exception(exc)
            return
        self._complete(job, fut, result)

    def _gather(self, job: Step, fut: Future) -> list[tuple[Step, Future]]:
        """The step just taken and the Step jobs of other sessions queued right behind it, up to
        `max_batch`; the first job that cannot join (another kind, or a second step of a session
        already in the batch) waits in `_deferred` and runs next, so each session's jobs keep
        their order."""
        batch, sessions = [(job, fut)], {job.session_id}
        expect, deadline = self._expected(), None
        while len(batch) < self.max_batch and not self._deferred:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                if len(batch) >= expect:
                    break
                now = time.monotonic()
                deadline = deadline or now + self.gather_s
                try:
                    item = self._jobs.get(timeout=deadline - now) if deadline > now else None
                except queue.Empty:
                    item = None
                if item is None:
                    break
            if item is None or not isinstance(item[0], Step) or item[0].session_id in sessions:
                self._deferred.append(item)
                break
            if item[1].set_running_or_notify_cancel():
                item[1].started = time.perf_counter()
                batch.append(item)
                sessions.add(item[0].session_id)
        if self.gather_s > 0:  # what _expected reads
            now = time.monotonic()
            for sid in sessions:
                self._recent[sid] = now
        return batch

    def _expected(self) -> int:
        """Sessions that stepped lately (within RECENT_S, or four times the last batch's duration
        where batches are slow): the batch a step may wait for (up to `gather_s`), since their
        next steps are likely on their way (the target's engine issues a round's draft steps
        together)."""
        if self.gather_s <= 0:
            return 1
        now, window = time.monotonic(), max(RECENT_S, 4 * self._batch_s)
        for sid in [s for s, t in self._recent.items() if now - t > window]:
            del self._recent[sid]
        return min(len(self._recent), self.max_batch)

    def _after_steps(self, jobs: list[Step]) -> None:
        """Work a batch of steps left for after their answers were handed over (none here)."""

    def _handed_over(self, futs: Sequence[Future]) -> None:
        """Waits (up to handover_wait_s in all) until the transports that asked have sent these jobs'
        answers: the wait releases the GIL to the thread that sends, which the thread's next Python
        would otherwise hold for up to a switch interval at a time."""
        deadline = None
        for f in futs:
            ev = getattr(f, "handover", None)
            if ev is not None and self.handover_wait_s > 0:
                deadline = deadline or time.monotonic() + self.handover_wait_s
                ev.wait(max(0.0, deadline - time.monotonic()))

    def _complete(self, job: Job, fut: Future, result, handover: bool = True) -> None:
        """The job's answer to its future (and, with `handover`, the wait for it to be sent on)."""
        self._answer(job, fut, result)
        if handover:
            self._handed_over([fut])

    def _answer(self, job: Job, fut: Future, result) -> None:
        if isinstance(result, BaseException):
            fut.set_exception(result)
            return
        if isinstance(job, Close):
            self._recent.pop(job.session_id, None)
        if isinstance(job, Open):  # what the open itself took: its wait behind other jobs is not its cost
            fut.ran_s = time.perf_counter() - getattr(fut, "started", time.perf_counter())
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
        if self._deferred:
            return self._deferred.popleft()
        while True:
            self._answer_prepared(due_only=True)
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            with self._timed("background_host_s"):
                flying = self._in_flight()  # finishes the slice if it is done
            if flying:
                try:
                    with self._timed("poll_s"):
                        return self._jobs.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            try:  # a job that came while the slice finished goes before the next launch (its host
                return self._jobs.get_nowait()  # work, ~0.4 ms, would be the job's wait)
            except queue.Empty:
                pass
            with self._timed("background_host_s"):
                launched = self._background()
            if not launched:
                self._answer_prepared()  # nothing left to draft: every prepare is answered now
                with self._timed("idle_s"):
                    return self._jobs.get()
            with self._lock:
                self._background_forwards += 1

    def _start_prepare(self, job: Prepare, fut: Future) -> None:
        """A Prepare job: answered later by `_answer_prepared` (here: not served)."""
        fut.set_exception(DraftError(f"{type(self).__name__} does not prepare outcomes"))

    def _answer_prepared(self, session_id: Optional[str] = None, due_only: bool = False) -> None:
        """Answer the pending prepares (of one session; with `due_only`, those whose time has come)."""

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

    def _do_steps(self, jobs: list[Step], counts: BatchCounts) -> list:
        """Several sessions' steps (one, or up to max_batch): each one's tree or exception, in order."""
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
