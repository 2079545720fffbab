"""ZeroMQ step channel, client side (docs/architecture.md, "Wire protocol"; messages: zmq_wire.py).

`StepChannelClient.call` sends one serialized StepRequest and returns the serialized DraftTree, or
raises StepFailed with the status code the step ended with. Its sockets are DEALERs, each used by
one thread at a time: a call takes an idle one from a small pool (or connects a new one) and gives
it back, so the engine's draft-call threads step different sessions at once over as many
connections as run at once, never one per session.

Deadline: the call polls for its reply until `timeout_s` (DEADLINE_EXCEEDED). Every request has an
id of its own; a reply with another id (the late answer to a request given up on, on this socket)
is dropped. A socket sends only on a live connection (zmq.IMMEDIATE): nothing is queued to a draft
that is gone. A monitor on each socket reports a dropped or refused connection, which fails the
call at once as UNAVAILABLE (rather than at its deadline) and retires the socket.

A socket never reconnects (RECONNECT_IVL -1): a lost socket is retired and the next call connects
a new one. This bounds what its monitor can be sent to a few events in its life. It matters:
libzmq's I/O thread sends monitor events with a blocking send, so a socket that kept retrying a
draft that had gone (an event every 100 ms) while it sat idle in the pool, its monitor unread,
filled the monitor's pipe within minutes and then blocked the I/O thread shared by every socket of
the process: no step channel in it could connect again (seen in CI, 2026-11-23). For the same
reason a socket's monitor is always stopped before either socket closes, garbage collection
included (`_close_monitored`).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from typing import Optional

import grpc
import zmq

from specextend.rpc.auth import frame_token
from specextend.rpc.zmq_wire import decode_reply, encode_request, is_ipv6

MAX_IDLE_SOCKETS = 16  # idle connections kept (the engine steps from 8 threads: scheduler.Batcher)
# monitor events meaning the connection is gone or will not come: the socket is retired
# (EVENT_CLOSED: a refused connect, with reconnection off)
_LOST = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class StepFailed(Exception):
    """A step that did not come back as a tree: `code` is its status (the server's, or
    DEADLINE_EXCEEDED / UNAVAILABLE from this side)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1e3))


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """The monitor stopped first, then its socket closed, then the socket: libzmq's I/O thread
    sends a monitor event with a blocking send, so an event for a monitor socket already closed
    (as garbage collection closes sockets, in any order) blocks that thread, shared by every socket
    of the process, for good."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(0)
    sock.close(0)


class _Socket:
    """One DEALER connected to the channel, with its connection monitor."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no connection: send fails (Again), nothing queued
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)  # lost or refused: retired, never retried (above)
        if is_ipv6(endpoint):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.monitor = self.sock.get_monitor_socket(_LOST)
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.lost = False
        # closed in this order however it ends, garbage collection of a client never shut down
        # included (the finalizer holds both sockets until it runs)
        self._close = weakref.finalize(self, _close_monitored, self.sock, self.monitor)

    def close(self) -> None:
        self._close()

    def call(self, message: bytes, request_id: int, timeout_s: float) -> tuple[grpc.StatusCode, bytes]:
        deadline = time.monotonic() + timeout_s
        self._send(message, deadline)
        return self.reply(request_id, deadline)

    def reply(self, request_id: int, deadline: float) -> tuple[grpc.StatusCode, bytes]:
        """Waits (until `deadline`, monotonic) for the reply to `request_id`, sent on this socket."""
        while True:
            events = dict(self.poller.poll(_ms(deadline - time.monotonic())))
            if self.sock in events:
                while True:
                    try:
                        reply_id, code, body = decode_reply(self.sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if reply_id == request_id:
                        return code, body
                    # else a late reply to a request given up on: dropped
            if self.monitor in events:
                self._lose("the connection to the draft dropped")
            if time.monotonic() >= deadline:
                raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply within the step's deadline")

    def _send(self, message: bytes, deadline: float) -> None:
        try:
            self.sock.send(message, zmq.NOBLOCK)
            return
        except zmq.Again:  # not connected yet (a new socket), or no longer
            pass
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLOUT)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_ms(deadline - time.monotonic())))
            if self.monitor in events:
                self._lose("cannot connect to the draft")
            if self.sock in events:
                try:
                    self.sock.send(message, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if time.monotonic() >= deadline:
                raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "not connected within the step's deadline")

    def _lose(self, details: str) -> None:
        self.lost = True
        raise StepFailed(grpc.StatusCode.UNAVAILABLE, details)


class StepChannelClient:
    """Steps over the channel at `endpoint` ("tcp://127.0.0.1:port", from the server's
    OpenSessionReply / HealthReply) with the server's token; safe to share between threads."""

    def __init__(self, endpoint: str, token: Optional[str] = None) -> None:
        self.endpoint = endpoint
        self._token = frame_token(token)
        self._ctx = zmq.Context.instance()  # the process's (I/O thread shared; never terminated)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards the idle pool and `closed`
        self._idle: list[_Socket] = []
        self.closed = False

    def warm(self) -> None:
        """Connects one socket ahead of the first step (off its path), if none is idle."""
        with self._lock:
            if self._idle or self.closed:
                return
        self._give_back(_Socket(self._ctx, self.endpoint))

    def call(self, request: bytes, timeout_s: float) -> bytes:
        """StepRequest bytes -> DraftTree bytes; raises StepFailed."""
        request_id = next(self._ids)  # u64 on the wire
        sock = self._take()
        try:
            code, body = sock.call(encode_request(self._token, request_id, request), request_id, timeout_s)
        finally:
            self._give_back(sock)
        if code != grpc.StatusCode.OK:
            raise StepFailed(code, body.decode("utf-8", "replace"))
        return body

    def start(self, request: bytes) -> Optional["PendingStep"]:
        """Sends `request` now, without blocking, on an idle connected socket; its reply is read by
        `PendingStep.result` (on any thread). None, with nothing sent, where no socket is idle or
        the send would block: the caller then makes a `call`."""
        with self._lock:
            if self.closed or not self._idle:
                return None
            sock = self._idle.pop()
        if sock.monitor.get(zmq.EVENTS) & zmq.POLLIN:  # its connection dropped while it was idle
            sock.close()
            return None
        request_id = next(self._ids)
        try:
            sock.sock.send(encode_request(self._token, request_id, request), zmq.NOBLOCK)
        except zmq.ZMQError:  # (Again: not connected, or no room) nothing was sent
            self._give_back(sock)
            return None
        return PendingStep(self, sock, request_id)

    def close(self) -> None:
        """Closes the idle sockets; those in use close when their calls end."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _take(self) -> _Socket:
        while True:
            with self._lock:
                if self.closed:
                    raise StepFailed(grpc.StatusCode.UNAVAILABLE, "the step channel client is closed")
                if not self._idle:
                    break
                sock = self._idle.pop()
            if not sock.monitor.get(zmq.EVENTS) & zmq.POLLIN:
                return sock
            sock.close()  # its connection dropped while it was idle
        return _Socket(self._ctx, self.endpoint)

    def _give_back(self, sock: _Socket) -> None:
        with self._lock:
            if not (sock.lost or self.closed or len(self._idle) >= MAX_IDLE_SOCKETS):
                self._idle.append(sock)
                return
        sock.close()


class PendingStep:
    """A request sent by StepChannelClient.start: `result` waits for its reply (once)."""

    def __init__(self, client: StepChannelClient, sock: _Socket, request_id: int) -> None:
        self._client, self._sock, self._id = client, sock, request_id

    def result(self, timeout_s: float) -> bytes:
        """The reply's DraftTree bytes within `timeout_s`; raises StepFailed (as `call` does)."""
        try:
            code, body = self._sock.reply(self._id, time.monotonic() + timeout_s)
        finally:
            self._client._give_back(self._sock)
        if code != grpc.StatusCode.OK:
            raise StepFailed(code, body.decode("utf-8", "replace"))
        return body
