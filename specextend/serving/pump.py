"""Runs the replica's sessions on its engine thread, ahead of the HTTP side.

The engine thread runs a scheduler.Batcher: every round advances each session one step and runs
their target forwards as one batched forward (docs/architecture.md, "Batched steps"). A
`SessionPump` is one request's end of it: the batcher hands each of the session's events to the
event loop as soon as the step is done, and goes on with the next step without waiting for the
loop to stream it out. The consumer takes every event that is ready at once, so a client that
lags gets several steps' tokens in one chunk; it may also hold a batch open until a deadline
(the replica's stream interval), so that fast plain steps share one item on the way out. At most
`max_ahead` events wait undelivered; beyond that the session's steps pause until the consumer
catches up.

docs/architecture.md, "Serving surface".
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Generator, Optional

from specextend.emit import StepEvent
from specextend.scheduler import Batcher
from specextend.session_calls import Load

MAX_AHEAD = 32  # undelivered events per session before its steps pause


class EngineThread:
    """The replica's one engine thread, running a Batcher until shut down."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self._thread = threading.Thread(target=batcher.run, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.batcher.shutdown()


def _terminal(item: Any) -> bool:
    return item is None or isinstance(item, BaseException) or item.finish_reason is not None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class SessionPump:
    def __init__(self, batcher: Batcher, session: Generator, loop: asyncio.AbstractEventLoop,
                 max_ahead: int = MAX_AHEAD, load: Optional[Load] = None) -> None:
        self._batcher = batcher
        self._loop = loop
        self._max_ahead = max_ahead
        self._lock = threading.Lock()  # guards what follows, shared with the engine thread
        self._ready: list = []  # undelivered events
        self._paused = False
        self._waiter: Optional[asyncio.Future] = None  # the consumer's, while it waits
        self._wake_on_any = True  # False while it holds a batch open: wake only for its end
        self._entry = batcher.add(session, self._sink, load)

    def _sink(self, item: Any) -> bool:  # on the engine thread: an event, None (ended) or an exception
        """One lock and an append per step; the event loop is woken only when the consumer waits
        for this event (not for each step of a batch it holds open)."""
        with self._lock:
            self._ready.append(item)
            go_on = len(self._ready) < self._max_ahead
            self._paused = not go_on
            waiter = self._waiter
            if waiter is not None and (self._wake_on_any or not go_on or _terminal(item)):
                self._waiter = None
            else:
                waiter = None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)
        return go_on

    async def events(self, until: float = 0.0) -> list[StepEvent]:
        """The next events: at least one, and every other one already there; then, until the loop's
        clock reads `until`, every one that arrives, unless the session ends or finishes first (a
        finish is never held). An event of None ends the steps; an engine error is raised here."""
        while True:
            with self._lock:
                ready = self._ready
                done = ready and (_terminal(ready[-1]) or self._paused or self._loop.time() >= until)
                if done:
                    self._ready, resume, self._paused = [], self._paused, False
                else:
                    self._waiter, self._wake_on_any = self._loop.create_future(), not ready
                    waiter = self._waiter
            if done:
                break
            if ready:  # hold the batch open until `until`, or until its end arrives
                await asyncio.wait((waiter,), timeout=max(until - self._loop.time(), 0.0))
            else:
                await waiter
            with self._lock:
                self._waiter = None
        if resume:
            self._batcher.resume(self._entry)
        for item in ready:
            if isinstance(item, BaseException):
                raise item
        return ready

    def stop(self) -> None:
        """No more steps; the engine thread closes the session at its next round (after any forward
        in flight), which releases the request's draft session and caches."""
        self._batcher.stop(self._entry)
