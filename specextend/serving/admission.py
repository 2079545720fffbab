"""Admission control of one replica: at most `max_sessions` active sessions whose reserved KV
bytes fit `budget_bytes`, then a FIFO queue of at most `max_queued` waiting requests, then 429.
The target's prefix cache holds what the sessions leave free of the budget: admitting a session
shrinks it to the rest (docs/architecture.md, "Prefix caching").

Runs on the replica's event loop only (no locks). A request that can never fit the budget is a
400, not a wait.
"""

from __future__ import annotations

import asyncio
from collections import deque

from specextend.serving.errors import BadRequestError, QueueFullError

MIB = 1 << 20


class Admission:
    def __init__(self, max_sessions: int, max_queued: int, budget_bytes: int, prefixes=None) -> None:
        self.prefixes = prefixes  # a PrefixCache, or None
        if prefixes is not None:  # (read on the engine's thread: a racy int read, shrunk again at admissions)
            prefixes.room = lambda: self.budget_bytes - self.reserved
        self.max_sessions = max_sessions
        self.max_queued = max_queued
        self.budget_bytes = budget_bytes
        self.active = 0  # admitted sessions
        self.reserved = 0  # KV bytes reserved by admitted sessions
        self._queue: deque[tuple[int, asyncio.Future]] = deque()  # (bytes, future) in arrival order

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _fits(self, need: int) -> bool:
        return self.active < self.max_sessions and self.reserved + need <= self.budget_bytes

    def _admit(self, need: int) -> None:
        self.active += 1
        self.reserved += need
        if self.prefixes is not None:
            self.prefixes.shrink(self.budget_bytes - self.reserved)

    async def acquire(self, need: int) -> None:
        """Waits for a session slot with `need` KV bytes; QueueFullError if the queue is full."""
        if need > self.budget_bytes:
            raise BadRequestError(
                f"this request needs {need / MIB:.0f} MiB of KV cache; the replica's budget is "
                f"{self.budget_bytes / MIB:.0f} MiB: shorten the prompt or max_tokens")
        if not self._queue and self._fits(need):
            self._admit(need)
            return
        if len(self._queue) >= self.max_queued:
            raise QueueFullError(f"{self.active} sessions active and {len(self._queue)} requests queued; "
                                 "retry later")
        entry = (need, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry in self._queue:
                self._queue.remove(entry)
            elif entry[1].done() and not entry[1].cancelled():
                self.release(need)  # admitted, then cancelled before it could start
            raise

    def release(self, need: int) -> None:
        self.active -= 1
        self.reserved -= need
        while self._queue and self._fits(self._queue[0][0]):
            need_next, fut = self._queue.popleft()
            if fut.done():  # cancelled while queued; its waiter is unwinding
                continue
            self._admit(need_next)
            fut.set_result(None)


CPU_KV_FRACTION = 0.25  # default KV budget on CPU: this share of the host's memory
GPU_KV_FRACTION = 0.9  # default KV budget on CUDA: this share of free memory after warm-up


def kv_budget(available: int, fraction: float, prefix_cache_gb: float, draft_shares: bool) -> int:
    """Admission's KV bytes by default: `fraction` of `available`, less the draft's prefix cache
    where the draft runs on the same device (the target's lives in the budget, in what the sessions
    leave free: Admission; docs/architecture.md, "Prefix caching")."""
    return max(int(available * fraction) - (int(prefix_cache_gb * 2**30) if draft_shares else 0), 0)
