"""The draft model's worker (docs/architecture.md, "Draft side"), on the job queue of jobs.py.

One thread owns the draft model and every session's state; nothing else touches them. Jobs:
`Open`, `Step`, `Prepare` (answered when due: docs/architecture.md, "Prepared outcomes") and `Close`
run in arrival order (the foreground); `Step` jobs of different
sessions waiting together in the queue run as one batch (up to `max_batch`), their forwards
batched level by level (batch.py). With overlap on, the
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
import sys
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generator, Optional

import torch

from specextend.draft.base import (DraftError, DraftSessionNotFound, DraftSessionParams, DraftStepOutOfOrder, DraftTree,
                                   Outcomes)
from specextend.draft.batch import BatchCounts, drive_batch
from specextend.draft.jobs import (POLL_S, Close, Job, JobWorker, Open, Prepare, SerialDraft,  # noqa: F401 (re-exported)
                                   Step, WorkerStats, as_worker, with_times)
from specextend.draft.session import OVERLAP_LEVELS, OVERLAP_ROWS, REFRESH_DEFER, SYNC_DEPTH, DraftSession
from specextend.models.batch import ForwardCall, Result
from specextend.models.decoder import Decoder
from specextend.models.full_graphs import FullStepGraphs
from specextend.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

# With overlap, the worker thread runs Python between background forwards while another thread
# (the gRPC loop receiving a step, or an in-process target) waits for the GIL: Python's default
# 5 ms switch interval would add up to 5 ms to a step. Lowered, process-wide, when overlap is on.
SWITCH_INTERVAL_S = 0.0002
# Step jobs of different sessions run as one batch at most (the target's engine issues draft calls
# from 8 threads: scheduler.Batcher)
MAX_BATCH = 8
# Batched steps split their tree expansions into levels batched across sessions (draft/batch.py says
# why not by default)
BATCH_LEVELS = False
# Batched steps' whole tree expansions of one shape run as one graph (draft/tree_batch.py)
BATCH_TREES = True
# How long a step may wait for the steps of the other sessions that stepped recently (jobs.py)
GATHER_S = 0.001
# Verdicts a prepare answers trees for (docs/architecture.md, "Prepared outcomes")
OUTCOMES = 16


@dataclass
class SessionEntry:
    session: DraftSession
    last_step: int = -1  # the last step applied (a retry of it returns last_tree)
    last_tree: Optional[DraftTree] = None


class DraftWorker(JobWorker):
    """The draft model's worker: sessions, idempotent steps (batched across sessions), overlapped
    drafting in the background."""

    batches_steps = True

    def __init__(self, model: Decoder, name: str = "draft", prefill_chunk: int = 2048, overlap: bool = False,
                 overlap_rows: int = OVERLAP_ROWS, sync_depth: int = SYNC_DEPTH, max_batch: int = MAX_BATCH,
                 gather_s: float = GATHER_S, overlap_levels: int = OVERLAP_LEVELS,
                 refresh_defer: int = REFRESH_DEFER, answer_first: bool = True, prepare: bool = False,
                 handover: bool = True, prefix_cache: Optional[PrefixCache] = None, own_stream: bool = True,
                 batch_levels: bool = BATCH_LEVELS, batch_trees: bool = BATCH_TREES):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model = model
        self.batch_levels = batch_levels  # batched steps' tree levels as forwards of several sessions
        self.batch_trees = batch_trees  # ... or their whole expansions of one shape as one graph
        self.max_batch, self.gather_s = max_batch, gather_s
        self.sync_depth = sync_depth
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache  # recent prompts' K/V, for the sessions' prefills (not the warm-up's)
        self.overlap = overlap
        self.overlap_rows = overlap_rows
        self.overlap_levels = overlap_levels
        self.refresh_defer = refresh_defer
        self.answer_first = answer_first  # a ready step's K/V moves after its answer (False: before it)
        self.prepares = prepare  # prepared outcomes (with overlap)
        if not handover:  # go on at once after answering (jobs.py, `_handed_over`)
            self.handover_wait_s = 0.0
        self._prepared: dict[str, tuple[float, Future]] = {}  # session -> (when due, perf_counter; its future)
        if overlap and sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._sessions: dict[str, SessionEntry] = {}  # the worker thread's only
        self._pending: OrderedDict[str, None] = OrderedDict()  # sessions with drafting left to do
        self._flying: Optional[DraftSession] = None  # the session whose background forward is in flight
        self.own_stream = own_stream  # (False: the default stream, as in a draft actor, alone on its GPU)
        self.stream: Optional[torch.cuda.Stream] = None  # the thread's own (CUDA; _setup)
        super().__init__(name)

    def _setup(self) -> None:
        # the thread's current device is the model's (CUDA graphs and streams are per device), and its
        # current stream one of its own: on the target's GPU, the draft's kernels then run beside the
        # target's instead of queueing behind them on the legacy default stream (docs/architecture.md,
        # "Overlapped drafting", one GPU). Everything the thread queues goes there (current streams are
        # per thread); what crosses to the target is host data, or read after an event (retrieval.py).
        # A draft actor has its GPU to itself and keeps the default stream (own_stream=False).
        if self.model.device.type == "cuda":
            torch.cuda.set_device(self.model.device)
            if self.own_stream:
                self.stream = torch.cuda.Stream(self.model.device)
                torch.cuda.set_stream(self.stream)

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

    @property
    def supports_prepare(self) -> bool:
        return self.overlap and self.prepares

    def _start_prepare(self, job: Prepare, fut: Future) -> None:
        """Apply the verdict now, as a step would (its tree unused), and leave the answer for when
        it is due: the background grows the pool meanwhile."""
        entry = self._sessions.get(job.session_id)
        try:
            if entry is None:
                raise DraftSessionNotFound(f"unknown draft session {job.session_id!r}")
            if not self.supports_prepare:
                raise DraftError("this draft worker does not prepare outcomes (overlap off)")
            if job.accepted_tokens:
                (out,) = drive_batch(self.model, [self._step_co(Step(job.session_id, job.step, job.accepted_tokens,
                                                                     job.retrieval))])
                if isinstance(out, BaseException):
                    raise out
                entry.session.settle()
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
            fut.set_exception(exc)
            return
        self._prepared[job.session_id] = (fut.started + job.due_s, fut)

    def _answer_prepared(self, session_id: Optional[str] = None, due_only: bool = False) -> None:
        if not self._prepared:
            return
        now = time.perf_counter()
        for sid in [session_id] if session_id is not None else list(self._prepared):
            item = self._prepared.get(sid)
            if item is None or (due_only and now < item[0]):
                continue
            del self._prepared[sid]
            fut, entry = item[1], self._sessions.get(sid)
            try:
                if entry is None:
                    raise DraftSessionNotFound(f"unknown draft session {sid!r}")
                trees = entry.session.outcomes(entry.last_step + 1, OUTCOMES)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
                fut.set_exception(exc)
                continue
            fut.set_result(with_times(Outcomes(entry.last_step + 1, tuple(trees)), fut))

    def _after_steps(self, jobs) -> None:
        """A ready answer's K/V moves (overlap.py, `settle`), queued once the answer is handed over."""
        for job in jobs:
            entry = self._sessions.get(job.session_id)
            if entry is None:
                continue
            try:
                entry.session.settle()
            except Exception:  # noqa: BLE001 - as in _background: the next step drafts anew
                log.exception("settling a ready step failed for session %s", job.session_id)
                entry.session.drop_pool()

    def _do(self, job: Job):
        """Every job but Step (those go to _do_steps, batched)."""
        if isinstance(job, Open):
            return self._open(job)
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
                self._chained_nodes += s.chained_nodes
                self._dropped_levels += s.dropped_levels
        return None

    def _new_session(self, prompt_ids, params: DraftSessionParams, prefix: Optional[PrefixCache] = None) -> DraftSession:
        """A session on this worker's model with its drafting settings (prefills the prompt)."""
        return DraftSession(self.model, prompt_ids, params, self.prefill_chunk, overlap=self.overlap,
                            overlap_rows=self.overlap_rows, sync_depth=self.sync_depth,
                            overlap_levels=self.overlap_levels, refresh_defer=self.refresh_defer, prefix=prefix)

    def _open(self, job: Open) -> None:
        if not job.prompt_ids:
            raise DraftError("empty prompt")
        session = self._new_session(job.prompt_ids, job.params, self.prefix_cache)
        if self.model.device.type == "cuda":
            # an open is done when its prefill has run on the device, not when its kernels are queued
            # (it returned with 16K tokens' prefill still queued, H200, tests/test_open_done.py): the
            # engine joins a done open and asks for a tree at once, and the open's seconds prime the
            # draft's price (docs/architecture.md, "Draft side")
            torch.cuda.current_stream(self.model.device).synchronize()
        self._sessions[job.session_id] = SessionEntry(session)

    def _do_steps(self, jobs: list[Step], counts: BatchCounts) -> list:
        return drive_batch(self.model, [self._step_co(job) for job in jobs], counts, self.batch_levels,
                           self.batch_trees)

    def _step_co(self, job: Step) -> Generator[ForwardCall, Result, DraftTree]:
        entry = self._sessions.get(job.session_id)
        if entry is None:
            raise DraftSessionNotFound(f"unknown draft session {job.session_id!r}")
        if job.step == entry.last_step and entry.last_tree is not None:
            return entry.last_tree  # a retried step: applied once, same tree
        if job.step != entry.last_step + 1:
            raise DraftStepOutOfOrder(f"session {job.session_id!r}: step {job.step} after {entry.last_step}")
        tree = yield from entry.session.step_co(job.step, job.accepted_tokens, job.retrieval, job.bound)
        entry.last_step, entry.last_tree = job.step, tree
        if self.overlap:
            self._pending[job.session_id] = None
        return tree

    def warm_up(self, params: DraftSessionParams, prompt_len: int = 64) -> int:
        """Before traffic: with batch_levels, the tree levels of several sessions batched as one
        forward (each level's shape, 2..max_batch sessions); then a throwaway session catches up on plain steps' tokens
        (the padded catch-up forward's shape) and, with overlap, runs the background forwards at
        every shape they take, so their CUDA graphs are captured now, not on a request's path.
        Returns the background forwards run (0 without overlap)."""
        if not self.overlap and not DraftSession.pads_catch_up(self.model) and not self._batches_trees():
            return 0  # nothing to capture
        return self.submit(_WarmUp(params, prompt_len)).result()

    def _warm_up(self, job: "_WarmUp") -> int:
        tree = job.params.tree
        if self.batch_levels and self.max_batch > 1 and self.model.graphs is not None:
            # levels of several sessions' trees as one forward (models/batch.py)
            self.model.graphs.warm_batches([tree.topk], self.max_batch,
                                           staged=[d * tree.topk for d in range(max(tree.depth - 1, 1))])
        vocab = self.model.args.vocab_size
        prompt = [(17 * i + 3) % vocab for i in range(job.prompt_len)]
        session = self._new_session(prompt, job.params)
        if self.overlap:  # every count of accepted tokens a step forwards (ready steps skip that forward,
            # so a target's warm-up requests need not meet each count); a throwaway session of its own
            spare = self._new_session(prompt, job.params)
            for t in range(1, job.params.tree.depth + 2):
                spare.forward_committed(prompt[:t])
        session.step(0, [prompt[-1]], None)
        if self._batches_trees():  # the configured tree's batched expansions, 2, 4, ... sessions
            n = 2
            while n <= self.max_batch:
                spares = [self._new_session(prompt, job.params) for _ in range(n)]
                drive_batch(self.model, [s.step_co(0, [prompt[-1]], None) for s in spares], batch_trees=True)
                n *= 2
        if session.pads_catch_up(self.model):
            session.step(1, prompt[:job.params.tree.depth + 2], None)  # more than a step accepts: a catch-up
        return session.warm_up() if self.overlap else 0

    def _batches_trees(self) -> bool:
        """Batched whole expansions are on and the model has tree graphs to batch (CUDA graphs)."""
        g = self.model.graphs
        return self.batch_trees and self.max_batch > 1 and isinstance(g, FullStepGraphs) and g.capture

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
