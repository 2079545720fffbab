"""The draft model in the caller's process: sessions keyed by id, step numbers made idempotent."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from specextend.draft.base import (DraftBackend, DraftError, DraftSessionNotFound, DraftSessionParams,
                                   DraftStepOutOfOrder, DraftTree, Retrieval)
from specextend.draft.session import DraftSession
from specextend.models.decoder import Decoder


class InProcessDraft(DraftBackend):
    def __init__(self, model: Decoder, name: str = "draft", prefill_chunk: int = 2048):
        self.model = model
        self.name = name
        self.prefill_chunk = prefill_chunk
        self._sessions: dict[str, tuple[DraftSession, list]] = {}  # id -> (session, [last_step, tree])
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set: abandon the speculation in flight
        self._speculating: Optional[str] = None  # the session whose speculation runs now
        self.requests_seen = 0  # requests announced through interrupt()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> None:
        if not prompt_ids:
            raise DraftError("empty prompt")
        session = DraftSession(self.model, prompt_ids, params, self.prefill_chunk)
        with self._lock:
            self._sessions[session_id] = (session, [-1, None])

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None) -> DraftTree:
        with self._lock:
            entry = self._sessions.get(session_id)
        if entry is None:
            raise DraftSessionNotFound(f"unknown draft session {session_id!r}")
        session, last = entry
        if step == last[0] and last[1] is not None:
            return last[1]  # a retried step: applied once, same tree
        if step != last[0] + 1:
            raise DraftStepOutOfOrder(f"session {session_id!r}: step {step} after {last[0]}")
        tree = session.step(step, accepted_tokens, retrieval)
        last[0], last[1] = step, tree
        return tree

    # ------------------------------------------------------------ pipelined drafting
    def speculate(self, session_id: str, requests_seen: Optional[int] = None) -> None:
        """Draft the session's next step ahead of its request (DraftSession.speculate). Runs where
        the steps run (the draft server's worker), after a step has been answered; skipped if a
        request was announced since `requests_seen` (it is waiting for this worker)."""
        if requests_seen is not None and requests_seen != self.requests_seen:
            return
        with self._lock:
            entry = self._sessions.get(session_id)
        if entry is None or entry[1][1] is None:
            return
        self._stop.clear()
        self._speculating = session_id
        try:
            entry[0].speculate(entry[1][1], self._stop.is_set)
        finally:
            self._speculating = None

    def interrupt(self, session_id: Optional[str] = None, accepted: Sequence[int] = ()) -> None:
        """A request is coming (from any thread): abandon the speculation in flight, unless it is
        this session's step and may be the guessed one."""
        self.requests_seen += 1
        running = self._speculating
        if running is None:
            return
        with self._lock:
            entry = self._sessions.get(running)
        spec = entry[0].speculation if entry is not None else None
        if running != session_id or spec is None or not spec.may_match(accepted):
            self._stop.set()

    def pipeline_hits(self, session_id: str) -> int:
        entry = self._sessions.get(session_id)
        return entry[0].pipeline_hits if entry else 0

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def refreshes(self, session_id: str) -> int:
        entry = self._sessions.get(session_id)
        return entry[0].refreshes if entry else 0
