"""Runs one request's engine steps on the replica's engine thread, ahead of the HTTP side.

The engine thread is shared by every session of the replica: each step is one task on it, so
sessions interleave step by step. A finished step queues the session's next step itself, on the
engine thread, and hands its event to the event loop; the engine never waits for the loop to
stream a step out before computing the next (it used to: each step was scheduled by the loop
after the previous one had been consumed). The consumer takes every event that is ready at once,
so a client that lags gets several steps' tokens in one chunk. At most `max_ahead` events wait
undelivered; beyond that the session's steps pause until the consumer catches up.

docs/architecture.md, "Serving surface".
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import Iterator, Optional

from specextend.engine import StepEvent

MAX_AHEAD = 32  # undelivered events per session before its steps pause


class StepPump:
    def __init__(self, steps: Iterator[StepEvent], executor: Executor, loop: asyncio.AbstractEventLoop,
                 max_ahead: int = MAX_AHEAD) -> None:
        self._steps = steps
        self._executor = executor
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_ahead = max_ahead
        self._lock = threading.Lock()  # guards the two flags below and the undelivered count
        self._undelivered = 0
        self._paused = False
        self._stopped = False
        self._executor.submit(self._step)

    def _step(self) -> None:  # on the engine thread
        with self._lock:
            if self._stopped:
                return
        try:
            ev: Optional[StepEvent] = next(self._steps, None)
            item = ev
        except BaseException as exc:  # noqa: BLE001 - the consumer re-raises it
            ev, item = None, exc
        done = ev is None or ev.finish_reason is not None
        with self._lock:
            self._undelivered += 1
            again = not done and not self._stopped
            if again and self._undelivered >= self._max_ahead:
                self._paused, again = True, False
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        if again:
            self._executor.submit(self._step)

    async def events(self) -> list[StepEvent]:
        """The next events: at least one, and every other one already there. An event of None ends
        the steps; an engine error is raised here."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        with self._lock:
            self._undelivered -= len(items)
            resume = self._paused and not self._stopped
            self._paused = False
        if resume:
            self._executor.submit(self._step)
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items

    def stop(self) -> None:
        """No more steps are queued; then closes the engine's iterator on the engine thread (after
        any step in flight), which releases the request's draft session and caches."""
        with self._lock:
            self._stopped = True
        self._executor.submit(self._steps.close)
