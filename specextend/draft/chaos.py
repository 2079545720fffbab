"""A DraftBackend wrapper that perturbs the cross-model signal, for stress tests and benchmarks.

It delays each Step (injected RPC latency), applies retrieval updates k steps late, drops a
fraction of them, and can send each update twice. Losslessness must not depend on any of this:
the draft only proposes; the target decides. Its counters say what it did (the `signal` bench
suite and its test read them; docs/architecture.md, "Baselines").
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from specextend.draft.base import DraftBackend, DraftSessionParams, DraftTree, Retrieval, TreeBound


@dataclass(frozen=True)
class Chaos:
    latency_s: float = 0.0  # added to every Step
    delay_steps: int = 0  # retrieval ids are applied this many steps late
    drop_rate: float = 0.0  # fraction of retrieval updates dropped
    duplicate: bool = False  # re-send the previous update with the next step as well
    seed: int = 0


@dataclass
class ChaosCounters:
    updates: int = 0  # retrieval updates the target sent
    dropped: int = 0  # of them, dropped
    late: int = 0  # delivered at least one step after they were sent
    repeated: int = 0  # deliveries of an update already delivered (duplicate)
    delivered: int = 0  # updates passed on to the draft, repeats included
    delivered_ids: int = 0  # chunk ids in them

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class ChaosDraft(DraftBackend):
    def __init__(self, inner: DraftBackend, chaos: Chaos):
        self.inner = inner
        self.chaos = chaos
        self._rng = random.Random(chaos.seed)
        self._pending: dict[str, deque] = {}
        self._last: dict[str, Optional[tuple[int, Retrieval]]] = {}
        self.counters = ChaosCounters()

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> Optional[float]:
        self._pending[session_id] = deque()
        self._last[session_id] = None
        return self.inner.open(session_id, prompt_ids, params)

    def step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
             retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> DraftTree:
        if self.chaos.latency_s:
            time.sleep(self.chaos.latency_s)
        return self.inner.step(session_id, step, accepted_tokens, self._signal(session_id, step, retrieval), bound)

    @property
    def supports_prepare(self) -> bool:
        return self.inner.supports_prepare

    def prepare(self, session_id: str, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
                due_s: float):
        """Passed on (no latency: a prepare runs beside the verification, off the step's path); the
        selection it carries with a verdict goes through the same perturbations as a step's."""
        if accepted_tokens:
            retrieval = self._signal(session_id, step, retrieval)
        return self.inner.prepare(session_id, step, accepted_tokens, retrieval, due_s)

    def _signal(self, session_id: str, step: int, retrieval: Optional[Retrieval]) -> Optional[Retrieval]:
        """The selection delivered with step `step`: `retrieval` late, dropped or repeated."""
        c, n = self.chaos, self.counters
        queue = self._pending.setdefault(session_id, deque())
        if retrieval is not None:
            n.updates += 1
            if self._rng.random() < c.drop_rate:
                n.dropped += 1
            else:
                queue.append((step + c.delay_steps, step, retrieval))
        due, repeat = None, False
        while queue and queue[0][0] <= step:
            due = queue.popleft()[1:]  # (sent at step, update); a newer due one supersedes an older one
        if due is None and c.duplicate and self._last.get(session_id) is not None:
            due, repeat = self._last[session_id], True
        if due is not None:
            self._last[session_id] = due
            n.delivered += 1
            n.delivered_ids += len(due[1].chunk_ids)
            n.repeated += repeat
            n.late += not repeat and due[0] < step
        return due[1] if due is not None else None

    def close(self, session_id: str) -> None:
        self._pending.pop(session_id, None)
        self._last.pop(session_id, None)
        self.inner.close(session_id)

    def health(self) -> bool:
        return self.inner.health()
