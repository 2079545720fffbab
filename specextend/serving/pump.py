"""Runs the replica's sessions on its engine thread, ahead of the HTTP side.

The engine thread runs a scheduler.Batcher: every round advances each session one step and runs
their target forwards as one batched forward (docs/architecture.md, "Batched steps"). A
`SessionPump` is one request's end of it: the batcher hands each of the session's events to the
event loop as soon as the step is done, and goes on with the next step without waiting for the
loop to stream it out. The consumer takes every event that is ready at once, so a client that
lags gets several steps' tokens in one chunk. At most `max_ahead` events wait undelivered; beyond
that the session's steps pause until the consumer catches up.

docs/architecture.md, "Serving surface".
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Generator, Optional

from specextend.engine import StepEvent
from specextend.scheduler import Batcher, Load

MAX_AHEAD = 32  # undelivered events per session before its steps pause


class EngineThread:
    """The replica's one engine thread, running a Batcher until shut down."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self._thread = threading.Thread(target=batcher.run, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.batcher.shutdown()


class SessionPump:
    def __init__(self, batcher: Batcher, session: Generator, loop: asyncio.AbstractEventLoop,
                 max_ahead: int = MAX_AHEAD, load: Optional[Load] = None) -> None:
        self._batcher = batcher
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._max_ahead = max_ahead
        self._lock = threading.Lock()  # guards the undelivered count and the paused flag
        self._undelivered = 0
        self._paused = False
        self._entry = batcher.add(session, self._sink, load)

    def _sink(self, item: Any) -> bool:  # on the engine thread: an event, None (ended) or an exception
        with self._lock:
            self._undelivered += 1
            go_on = self._undelivered < self._max_ahead
            self._paused = not go_on
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        return go_on

    async def events(self) -> list[StepEvent]:
        """The next events: at least one, and every other one already there. An event of None ends
        the steps; an engine error is raised here."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        with self._lock:
            self._undelivered -= len(items)
            resume, self._paused = self._paused, False
        if resume:
            self._batcher.resume(self._entry)
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items

    def stop(self) -> None:
        """No more steps; the engine thread closes the session at its next round (after any forward
        in flight), which releases the request's draft session and caches."""
        self._batcher.stop(self._entry)
