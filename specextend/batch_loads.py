"""What a batch's sessions tell its driver through their Loads (session_calls.Load), read over the
batcher's sessions (a mixin of scheduler.Batcher; docs/architecture.md, "Batched steps"): how long the
batch lasts, and its sessions' draft opens, under way or deferred."""

from __future__ import annotations

import math
from concurrent.futures import Future

from specextend.governor import bucket


class BatchLoads:
    _sessions: list  # scheduler._Entry: each with its `load` and `emitted`

    def life(self) -> float:
        """The rounds this batch keeps its size bucket (governor.bucket) if no session joins, at most:
        a round emits at least one token a session, so each session has at most its tokens left; the
        bucket ends when all but half of it have left (inf where a session's bound is unknown)."""
        left = sorted(e.load.max_tokens - e.emitted if e.load is not None and e.load.max_tokens is not None
                      else math.inf for e in self._sessions)
        if not left:
            return 0.0
        return left[len(left) - bucket(len(left)) // 2 - 1]

    def opening(self) -> bool:
        """Whether some session's draft open is under way (begun, not done): it steps plainly till then."""
        return self.openings() > 0

    def openings(self) -> int:
        """The sessions whose draft open is under way."""
        return len(self._opens())

    def opens_s(self) -> float:
        """The expected seconds of the sessions' deferred draft opens (Load.open_s)."""
        return sum(e.load.open_s for e in self._sessions if e.load is not None)

    def _opens(self) -> list[Future]:
        """The draft opens under way (their futures)."""
        return [e.load.opening for e in self._sessions
                if e.load is not None and e.load.opening is not None and not e.load.opening.done()]
