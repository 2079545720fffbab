"""One draft session's StepStream call, client side (docs/architecture.md, "Wire protocol").

A step puts its request on the call's request queue (gRPC's own thread sends it) and reads the
next tree from the call: no per-step call set-up, metadata or token check. gRPC bounds a call's
whole life, not each message, so the step's deadline is kept here: a watchdog thread (one per
process, alive while any stream is) cancels a call whose step is late, and that step fails as
DEADLINE_EXCEEDED. A stream that failed is dead; the client opens a new one for the next attempt.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable, Optional

import grpc

from specextend.v1 import draft_pb2 as pb

WATCH_TICK_S = 0.005  # how late a stuck step's deadline may be noticed


class StreamFailed(Exception):
    """A stream step that did not come back: `code` is what the call ended with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class SessionStream:
    """A StepStream call of one session; its steps are sequential (one in flight, as the engine
    sends them). `open_call` is the stub's StepStream with the call's metadata bound."""

    def __init__(self, open_call: Callable[..., grpc.Call]) -> None:
        self._requests: queue.SimpleQueue[Optional[pb.StepRequest]] = queue.SimpleQueue()
        self._call = open_call(iter(self._requests.get, None))
        self.deadline: Optional[float] = None  # monotonic; set while a step waits (the watchdog reads it)
        self.expired = False
        self.dead = False
        _WATCHDOG.watch(self)

    def step(self, request: pb.StepRequest, timeout_s: float) -> pb.DraftTree:
        if self.dead:
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE, "the stream was closed")
        self.deadline = time.monotonic() + timeout_s
        self._requests.put(request)
        try:
            return next(self._call)
        except grpc.RpcError as err:
            self.close()
            if self.expired:
                raise StreamFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the step's deadline passed") from err
            raise StreamFailed(err.code(), err.details() or "") from err
        except StopIteration as end:  # the server ended the stream with OK: not for a step in flight
            self.close()
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE, "the draft ended the stream") from end
        finally:
            self.deadline = None

    def expire(self) -> None:
        """The watchdog's: the step in flight is late."""
        self.expired = True
        self._call.cancel()

    def close(self) -> None:
        """Ends the call (idempotent); the server drops the step it may have queued."""
        if not self.dead:
            self.dead = True
            self._requests.put(None)  # ends gRPC's request thread
            self._call.cancel()
            _WATCHDOG.forget(self)


class _Watchdog:
    """Cancels the call of a stream whose step outlived its deadline. One thread, started when a
    stream is watched, ending when none is; every WATCH_TICK_S it reads each stream's deadline
    (no per-step signalling: a step only writes its own `deadline`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[SessionStream] = weakref.WeakSet()
        self._thread: Optional[threading.Thread] = None

    def watch(self, stream: SessionStream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="draft-stream-deadlines", daemon=True)
                self._thread.start()

    def forget(self, stream: SessionStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_TICK_S)
            with self._lock:
                streams = list(self._streams)
                if not streams:
                    self._thread = None
                    return
            now = time.monotonic()
            for stream in streams:
                deadline = stream.deadline
                if deadline is not None and now > deadline and stream.deadline is deadline:
                    stream.expire()


_WATCHDOG = _Watchdog()
