"""A DraftBackend wrapper that perturbs the cross-model signal, for stress tests and benchmarks.

It delays each Step (injected RPC latency), applies retrieval updates k steps late, drops a
fraction of them, and can send each update twice. Losslessness must not depend on any of this:
the draft only proposes; the target decides.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree, Retrieval, TreeBound


@dataclass(frozen=True)
class Chaos:
    latency_s: float = 0.0  # added to every Step
    delay_steps: int = 0  # retrieval ids are applied this many steps late
    drop_rate: float = 0.0  # fraction of retrieval updates dropped
    duplicate: bool = False  # re-send the previous update with the next step as well
    seed: int = 0


class ChaosDraft(DraftBackend):
    def __init__(self, inner: DraftBackend, chaos: Chaos):
        self.inner = inner
        self.chaos = chaos
        self._rng = random.Random(chaos.seed)
        self._pending: dict[str, deque] = {}
        self._last: dict[str, Optional[Retrieval]] = {}
        self.dropped = 0

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> None:
        self._pending[session_id] = deque()
        self._last[session_id] = None
        self.inner.open(session_id, prompt_ids, params)

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> DraftTree:
        c = self.chaos
        if c.latency_s:
            time.sleep(c.latency_s)
        queue = self._pending.setdefault(session_id, deque())
        if retrieval is not None:
            if self._rng.random() < c.drop_rate:
                self.dropped += 1
            else:
                queue.append((step + c.delay_steps, retrieval))
        due = None
        while queue and queue[0][0] <= step:
            due = queue.popleft()[1]  # a newer due update supersedes an older one
        if due is None and c.duplicate:
            due = self._last.get(session_id)
        if due is not None:
            self._last[session_id] = due
        return self.inner.step(session_id, step, accepted_tokens, due, bound)

    def close(self, session_id: str) -> None:
        self._pending.pop(session_id, None)
        self._last.pop(session_id, None)
        self.inner.close(session_id)

    def health(self) -> bool:
        return self.inner.health()
