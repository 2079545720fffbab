"""ZeroMQ step channel, server side: the per-step data plane beside DraftService (docs/architecture.md,
"Wire protocol").

One thread owns a ROUTER socket bound to host (loopback in production) on a free port, and serves
StepRequests from any number of clients and sessions (messages: zmq_wire.py). For each request it
checks the token (constant time; a wrong one is answered UNAUTHENTICATED and nothing is read
further), parses the StepRequest and submits the same worker job as gRPC's Step; it never waits
for the job. The job's future, completed on the worker's thread, hands its key back through a
queue and one byte on a pipe that the thread polls beside the socket (ZeroMQ sockets are not
thread-safe: only this thread touches the ROUTER). The thread then sends the DraftTree, or the
status code the failure maps to (errors.py), to the identity that asked.

Each request carries timeout_ms: when it passes, the step is answered DEADLINE_EXCEEDED and its job,
if still queued, is dropped (one already running completes: a retry of the step number finds it
applied). Steps of one session are sequential by the client; the worker applies step numbers in
order and a repeated one once (base.py). Stopping answers every pending step UNAVAILABLE.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import grpc
import zmq
from google.protobuf.message import DecodeError

from specextend.draft.base import Outcomes
from specextend.draft.jobs import with_times
from specextend.draft.worker import JobWorker
from specextend.rpc.auth import UNAUTHENTICATED_DETAILS, frame_token, token_matches
from specextend.rpc.convert import outcomes_to_proto, tree_to_proto
from specextend.rpc.errors import status_for
from specextend.rpc.server import step_from_proto
from specextend.rpc.zmq_wire import (MAX_MESSAGE_BYTES, BadRequest, decode_request, encode_reply, is_ipv6,
                                     tcp_bind_address)
from specextend.v1 import draft_pb2 as pb

logger = logging.getLogger(__name__)

STOP_LINGER_MS = 100  # how long the UNAVAILABLE answers of a stopping server may take to leave


@dataclass
class _Pending:
    identity: bytes  # the ROUTER's id of the client's connection
    request_id: int
    future: Optional[concurrent.futures.Future]  # the job's (set right after the entry)
    deadline: Optional[float]  # monotonic seconds; None: no timeout_ms
    received: float  # perf_counter when the request was read (with_times: the draft side's time)
    handover: threading.Event  # set once the answer is sent: the worker waits for it before going on


class StepChannel:
    """The ROUTER socket and its thread, over `worker` (the servicer's). Construction returns once
    the socket is bound (or raises what binding raised); `endpoint` is what clients connect to.
    `ipc=True` binds a Unix socket in a new private directory (mode 0700: only this user reaches
    it) instead of a free TCP port on `host`. With `token`, a step must carry it (rpc/auth.py)."""

    def __init__(self, worker: JobWorker, host: str = "127.0.0.1", *, token: Optional[str] = None,
                 ipc: bool = False) -> None:
        self.worker = worker
        self._dir = tempfile.mkdtemp(prefix="specextend-steps-") if ipc else None
        address = f"ipc://{self._dir}/steps" if self._dir else tcp_bind_address(host)
        self._expected = frame_token(token) if token is not None else None
        self._ctx = zmq.Context()  # its own I/O thread, ended by stop()
        self._pending: dict[int, _Pending] = {}  # this thread's only
        self._keys = itertools.count()
        self._completed: queue.SimpleQueue[int] = queue.SimpleQueue()  # keys of finished jobs
        self._wake_r, self._wake_w = os.pipe()  # one byte per finished job wakes the thread
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # the pipe is closed under it: no write to a reused fd
        self._closed = self._stopping = False
        bound: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(address, bound), name="draft-zmq-steps",
                                        daemon=True)
        self._thread.start()
        try:
            self.endpoint: str = bound.result()
        except BaseException:
            self._thread.join()
            self._release()
            raise

    def stop(self) -> None:
        """Answers the pending steps UNAVAILABLE, closes the socket, ends the thread (idempotent)."""
        if self._closed:
            return
        self._stopping = True
        self._wake()
        self._thread.join()
        self._release()

    def _release(self) -> None:
        self._close_pipe()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ any thread

    def _wake(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: the thread has wake-ups enough
                pass

    def _done(self, key: int, _future: concurrent.futures.Future) -> None:
        """A job finished (on the worker's thread, or here when it already had)."""
        self._completed.put(key)
        self._wake()

    def _close_pipe(self) -> None:
        with self._wake_lock:
            if not self._closed:
                self._closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    # ------------------------------------------------------------------ the channel's thread

    def _run(self, address: str, bound: concurrent.futures.Future) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.LINGER, STOP_LINGER_MS)
            if is_ipv6(address):
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(address)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            if "sock" in locals():
                sock.close(0)
            bound.set_exception(exc)
            return
        bound.set_result(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            self._serve(sock)
        except Exception:  # noqa: BLE001 - a bug here must not pass silently
            logger.exception("the draft's ZeroMQ step channel failed")
        finally:
            for p in self._pending.values():  # the server is going: nothing more will be answered
                p.future.cancel()
                self._send(sock, p, grpc.StatusCode.UNAVAILABLE, b"the draft server is stopping")
            self._pending.clear()
            sock.close()

    def _serve(self, sock: zmq.Socket) -> None:
        """The loop: as little Python per step as can be (each step wakes it twice: its request,
        then its job's completion)."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_r, completed = self._wake_r, self._completed
        timeout_ms = -1  # until the nearest pending deadline; -1: none
        while True:
            frames = None
            for which, _ in poller.poll(timeout_ms):
                if which is sock:  # one request per wake-up: poll answers at once while more wait
                    frames = sock.recv_multipart(zmq.NOBLOCK)  # [identity, request]
                else:
                    os.read(wake_r, 4096)
                    while not completed.empty():  # this thread is its only reader
                        self._finish(sock, completed.get())
            if self._stopping:
                return
            nearest = self._expire(sock) if self._pending else None
            if frames is not None:  # submitted last: the worker, woken by it, finds the GIL free soon
                deadline = self._request(sock, frames)
                if deadline is not None and (nearest is None or deadline < nearest):
                    nearest = deadline
            timeout_ms = -1 if nearest is None else max(0, int((nearest - time.monotonic()) * 1e3) + 1)

    def _request(self, sock: zmq.Socket, frames: list[bytes]) -> Optional[float]:
        """One request, [identity, request] (zmq_wire.py). Returns its deadline, if its job was
        submitted with one."""
        identity, received = frames[0], time.perf_counter()
        try:
            if len(frames) != 2:
                raise BadRequest()
            request_id, token, body = decode_request(frames[1])
        except BadRequest as bad:
            self._reply(sock, identity, bad.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(bad).encode())
            return None
        if self._expected is not None and not token_matches(token, self._expected):
            self._reply(sock, identity, request_id, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS.encode())
            return None
        try:
            request = pb.StepRequest.FromString(body)
        except DecodeError:
            self._reply(sock, identity, request_id, grpc.StatusCode.INVALID_ARGUMENT, b"malformed StepRequest")
            return None
        job = step_from_proto(request)
        deadline = time.monotonic() + request.timeout_ms / 1e3 if request.timeout_ms else None
        key = next(self._keys)
        pending = self._pending[key] = _Pending(identity, request_id, None, deadline, received, threading.Event())
        pending.future = self.worker.submit(job, handover=pending.handover)
        pending.future.add_done_callback(partial(self._done, key))
        return deadline

    def _finish(self, sock: zmq.Socket, key: int) -> None:
        """Answers the step whose job finished."""
        p = self._pending.pop(key, None)
        if p is None:  # answered already (its deadline passed)
            return
        if p.future.cancelled():  # not by this thread (it pops first): by whoever owns the worker
            self._send(sock, p, grpc.StatusCode.CANCELLED, b"the step was cancelled before the draft ran it")
            return
        exc = p.future.exception()
        if exc is None:
            result = with_times(p.future.result(), p.future, p.received)
            body = outcomes_to_proto(result) if isinstance(result, Outcomes) else tree_to_proto(result)
            self._send(sock, p, grpc.StatusCode.OK, body.SerializeToString())
            return
        code, details = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            logger.error("draft worker failed", exc_info=exc)
        self._send(sock, p, code, details.encode())

    def _expire(self, sock: zmq.Socket) -> Optional[float]:
        """Answers the steps past their deadline; returns the nearest deadline left (None: none)."""
        now, nearest = time.monotonic(), None
        for key, p in list(self._pending.items()):
            if p.deadline is None:
                continue
            if p.deadline <= now:
                del self._pending[key]
                p.future.cancel()  # still queued: dropped; running: completes, and a retry finds it
                self._send(sock, p, grpc.StatusCode.DEADLINE_EXCEEDED, b"the draft did not answer in time")
            elif nearest is None or p.deadline < nearest:
                nearest = p.deadline
        return nearest

    def _send(self, sock: zmq.Socket, p: _Pending, code: grpc.StatusCode, body: bytes) -> None:
        self._reply(sock, p.identity, p.request_id, code, body)
        p.handover.set()

    @staticmethod
    def _reply(sock: zmq.Socket, identity: bytes, request_id: int, code: grpc.StatusCode, body: bytes) -> None:
        try:
            sock.send_multipart((identity, encode_reply(request_id, code, body)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client is gone, or not reading (its queue is full)
            logger.debug("draft step reply dropped: %s", exc)
