"""gRPC client side of the draft: the DraftBackend the target's (synchronous) decode loop calls.

Every call carries a deadline; failures become DraftError subclasses (errors.py), on which the
engine falls back to plain decoding. A Step that hit DEADLINE_EXCEEDED or UNAVAILABLE is sent
once more with the same step number: the server applies a step number once (base.py's contract),
so a first attempt that did reach the draft is not applied twice.

Steps take the ZeroMQ step channel (zmq_client.py) when the server advertises one (its
OpenSessionReply / HealthReply `step_endpoint`) and the transport is "zmq" (the default): a step
that timed out there is sent once more on it; one that found the channel unreachable is sent once
more as a unary gRPC Step (gRPC is the fallback transport: a server that is gone fails it at once),
and the next step asks Health where the channel is now. Otherwise steps go over one StepStream call
per session (stream.py), opened with the session; a step that failed on it is sent once more on a
new stream, as above. A server without StepStream gets unary Steps (docs/architecture.md, "Wire
protocol").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal, Optional, Sequence

import grpc
from google.protobuf.message import DecodeError

from specextend.draft.base import (DraftBackend, DraftError, DraftSessionParams, DraftTree, Outcomes, Retrieval,
                                   TreeBound)
from specextend.rpc.auth import call_metadata
from specextend.rpc.convert import (outcomes_from_proto, params_to_proto, prepare_to_proto, step_to_proto,
                                    tree_from_proto)
from specextend.rpc.errors import RETRYABLE, STREAM_RETRYABLE, error_from_rpc, error_from_status
from specextend.rpc.stream import SessionStream, StreamFailed
from specextend.rpc.zmq_client import PendingStep, StepChannelClient, StepFailed
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

logger = logging.getLogger(__name__)

# Messages are small (a step is well under 1 KB; TCP_NODELAY is gRPC's default), so latency is
# all that matters: no gRPC-level retries (Step retries itself, once), keepalive pings to notice a
# dead draft node between steps, and a short reconnect backoff so a restarted server is found soon.
# threads that wait for the answers of prepares and started steps, one per call in flight: as many as
# a replica's sessions (max_concurrent_sessions, 16 by default) may have, with room; created on demand
WAITERS = 32
CHANNEL_OPTIONS = (
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def _tree_of(reply: pb.DraftTree, step: int) -> DraftTree:
    """The reply to step `step` as a DraftTree; a tree of another step is the draft's error."""
    tree = tree_from_proto(reply)
    if tree.step != step:
        raise DraftError(f"draft answered step {step} with the tree of step {tree.step}")
    return tree


@dataclass(frozen=True)
class DraftHealth:
    ok: bool
    sessions: int  # sessions open on the server
    model: str  # the draft model's name


class GrpcDraftBackend(DraftBackend):
    """DraftBackend over DraftService at `address` ("host:port"); safe to share between threads.

    timeout_s bounds Step, CloseSession and Health; open_timeout_s bounds OpenSession, which
    includes the draft's prefill of the whole prompt. `token` is the server's (rpc/auth.py),
    sent on every call. `transport="zmq"` steps over the server's ZeroMQ step channel when it has
    one; "grpc" (or a server without one) over gRPC: `stream=False` sends every step as a unary
    Step, else one StepStream per session."""

    def __init__(
        self, address: str, timeout_s: float = 10.0, open_timeout_s: float = 300.0, *,
        token: Optional[str] = None, stream: bool = True, transport: Literal["zmq", "grpc"] = "zmq",
    ) -> None:
        if transport not in ("zmq", "grpc"):
            raise ValueError(f"unknown step transport {transport!r}")
        self.timeout_s = timeout_s
        self.open_timeout_s = open_timeout_s
        self.streaming = stream  # turned off for good by a server without StepStream
        self.transport = transport
        self._token = token
        self._metadata = call_metadata(token)
        self._lock = threading.Lock()  # guards the (address, channel, stub) triple, the streams and _steps
        self._address = address
        self._channel: Optional[grpc.Channel] = None
        self._stub: Optional[draft_pb2_grpc.DraftServiceStub] = None
        self._streams: dict[str, SessionStream] = {}  # session id -> its StepStream
        self._steps: Optional[StepChannelClient] = None  # the server's ZeroMQ step channel, once advertised
        self._discover = False  # ask Health for the channel before the next step (set by reconnect)
        self._prepares = False  # the server's step channel answers prepares (its OpenSessionReply)
        self._waiters = ThreadPoolExecutor(WAITERS, thread_name_prefix="draft-waiter")  # a prepare's or a started step's wait for its answer
        self.reconnect(address)

    @property
    def address(self) -> str:
        return self._address

    @property
    def step_endpoint(self) -> Optional[str]:
        """The ZeroMQ step channel steps take now (None: they go over gRPC)."""
        steps = self._steps
        return steps.endpoint if steps is not None else None

    def reconnect(self, address: str) -> None:
        """Dials `address` (e.g. a restarted draft actor's); calls in flight on the old one fail. The
        next step asks the new server for its step channel."""
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        with self._lock:
            old, self._channel = self._channel, channel
            self._address, self._stub = address, draft_pb2_grpc.DraftServiceStub(channel)
            streams, self._streams = self._streams, {}
            steps, self._steps = self._steps, None
            self._discover = self.transport == "zmq"
        self._close_old(old, streams, steps)

    def shutdown(self) -> None:
        """Closes the channel; later calls raise DraftError (close() still does not)."""
        self._waiters.shutdown(wait=False)
        with self._lock:
            old, self._channel, self._stub = self._channel, None, None
            streams, self._streams = self._streams, {}
            steps, self._steps = self._steps, None
        self._close_old(old, streams, steps)

    @staticmethod
    def _close_old(channel: Optional[grpc.Channel], streams: dict[str, SessionStream],
                   steps: Optional[StepChannelClient] = None) -> None:
        for stream in streams.values():  # their sessions' next steps open streams on the new channel
            stream.close()
        if steps is not None:
            steps.close()
        if channel is not None:
            channel.close()

    # ------------------------------------------------------------------ the ZeroMQ step channel

    def _learn_endpoint(self, endpoint: str) -> None:
        """Where the server (OpenSessionReply, HealthReply) takes steps over ZeroMQ ("": nowhere)."""
        if self.transport != "zmq":
            return
        with self._lock:
            self._discover = False
            current = self._steps
            if self._stub is None or (current.endpoint if current is not None else "") == endpoint:
                return
            self._steps = StepChannelClient(endpoint, self._token) if endpoint else None
        if current is not None:
            current.close()
        if endpoint:
            logger.info("draft steps over ZeroMQ at %s", endpoint)

    def _forget_endpoint(self, steps: StepChannelClient) -> None:
        """The channel was unreachable: steps go over gRPC until Health names one again."""
        with self._lock:
            if self._steps is steps:
                self._steps, self._discover = None, True
        steps.close()

    def _step_channel(self) -> Optional[StepChannelClient]:
        if self._discover:  # after reconnect(), or the channel was lost: where is it now?
            self._discover = False
            try:
                self.server_health()
            except DraftError as exc:  # this step goes over gRPC, and fails there if the draft is gone
                logger.warning("draft health check failed: %s", exc)
        return self._steps

    def _bounded(self, request: pb.StepRequest) -> pb.StepRequest:
        """The request with the server's bound on the step (timeout_ms)."""
        request.timeout_ms = math.ceil(self.timeout_s * 1e3)
        return request

    def _stamped(self, request: pb.StepRequest) -> bytes:
        return self._bounded(request).SerializeToString()

    def _channel_step(self, steps: StepChannelClient, session_id: str, request: pb.StepRequest,
                      first: Optional[Callable[[], bytes]] = None, data: Optional[bytes] = None) -> pb.DraftTree:
        """The step over the channel, sent once more as the module says; `first`: its first
        attempt's reply, where the request was sent already as `data` (start_step)."""
        data = self._stamped(request) if data is None else data
        for attempt in (1, 2):
            try:
                if attempt == 1 and first is not None:
                    return pb.DraftTree.FromString(first())
                return pb.DraftTree.FromString(steps.call(data, self.timeout_s))
            except StepFailed as err:
                if attempt == 1 and err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    logger.warning("draft step channel at %s: DEADLINE_EXCEEDED, retrying", steps.endpoint)
                    continue
                if err.code == grpc.StatusCode.UNAVAILABLE:
                    self._forget_endpoint(steps)
                    if attempt == 1:
                        logger.warning("draft step channel at %s: UNAVAILABLE (%s), retrying over gRPC",
                                       steps.endpoint, err.details)
                        return self._call("Step", request, self.timeout_s)
                raise error_from_status(err.code, err.details, "Step", steps.endpoint, self.timeout_s) from err
            except DecodeError as err:
                raise DraftError(f"draft step channel at {steps.endpoint} sent a malformed DraftTree") from err

    # ------------------------------------------------------------------ gRPC

    def _session_stream(self, session_id: str) -> SessionStream:
        """The session's open stream, or a new one."""
        with self._lock:
            if self._stub is None:
                raise DraftError(f"the draft client for {self._address} is shut down")
            stream = self._streams.get(session_id)
            if stream is None or stream.dead:
                stream = SessionStream(partial(self._stub.StepStream, metadata=self._metadata))
                self._streams[session_id] = stream
            return stream

    def _drop_stream(self, session_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(session_id, None)
        if stream is not None:
            stream.close()

    def _stream_step(self, session_id: str, request: pb.StepRequest):
        self._bounded(request)
        for attempt in (1, 2):
            try:
                return self._session_stream(session_id).step(request, self.timeout_s)
            except StreamFailed as err:
                self._drop_stream(session_id)
                if err.code == grpc.StatusCode.UNIMPLEMENTED:  # a server from before StepStream
                    logger.warning("draft at %s has no StepStream: unary steps from now on", self._address)
                    self.streaming = False
                    return self._call("Step", request, self.timeout_s, attempts=2)
                if attempt == 1 and err.code in STREAM_RETRYABLE:
                    logger.warning("draft StepStream at %s: %s, retrying", self._address, err.code.name)
                    continue
                raise error_from_status(err.code, err.details, "StepStream", self._address, self.timeout_s) from err
            except ValueError as err:  # the channel was closed under us by reconnect()/shutdown()
                raise DraftError(f"draft StepStream at {self._address}: {err}") from err

    def _call(self, method: str, request, timeout_s: float, attempts: int = 1):
        with self._lock:
            stub, address = self._stub, self._address
        if stub is None:
            raise DraftError(f"the draft client for {address} is shut down")
        for attempt in range(1, attempts + 1):
            try:
                return getattr(stub, method)(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                if attempt < attempts and err.code() in RETRYABLE:
                    logger.warning("draft %s at %s: %s, retrying", method, address, err.code().name)
                    continue
                raise error_from_rpc(err, method, address, timeout_s) from err
            except ValueError as err:  # the channel was closed under us by reconnect()/shutdown()
                raise DraftError(f"draft {method} at {address}: {err}") from err

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> Optional[float]:
        request = pb.OpenSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, config=params_to_proto(params)
        )
        reply = self._call("OpenSession", request, self.open_timeout_s)
        if reply.prompt_tokens != len(prompt_ids):
            raise DraftError(
                f"draft received {reply.prompt_tokens} of {len(prompt_ids)} prompt tokens"
            )
        self._learn_endpoint(reply.step_endpoint)
        self._prepares = reply.prepares
        steps = self._steps
        if steps is not None:  # connected now, off the first step's path
            steps.warm()
        elif self.streaming:  # opened now, off the first step's path
            self._session_stream(session_id)
        return reply.open_s or None  # (the open's own seconds on the draft; 0: an older server's reply)

    def step(
        self,
        session_id: str,
        step: int,
        accepted_tokens: Sequence[int],
        retrieval: Optional[Retrieval] = None,
        bound: Optional[TreeBound] = None,
    ) -> DraftTree:
        request = step_to_proto(session_id, step, accepted_tokens, retrieval, bound)
        steps = self._step_channel()
        if steps is not None:
            reply = self._channel_step(steps, session_id, request)
        elif self.streaming:
            reply = self._stream_step(session_id, request)
        else:
            reply = self._call("Step", request, self.timeout_s, attempts=2)
        return _tree_of(reply, step)

    def start_step(self, session_id: str, step: int, accepted_tokens: Sequence[int],
                   retrieval: Optional[Retrieval] = None, bound: Optional[TreeBound] = None) -> Optional[Future]:
        """base.py's start_step over the step channel: the request sent now on this thread (no
        hand-off to a call thread), its reply read on a thread of this client's (retried as a
        step's is). None without a channel or an idle connection to it (the caller calls `step`)."""
        steps = self._steps
        if steps is None or self._discover or self._stub is None:
            return None
        out: Future = Future()
        out.submitted = time.perf_counter()
        request = step_to_proto(session_id, step, accepted_tokens, retrieval, bound)
        data = self._stamped(request)
        pending = steps.start(data)
        if pending is None:
            return None
        out.started = time.perf_counter()
        try:
            self._waiters.submit(self._finish_step, steps, session_id, step, request, data, pending, out)
        except RuntimeError:  # shut down meanwhile
            out.set_exception(DraftError("the draft client is shut down"))
        return out

    def _finish_step(self, steps: StepChannelClient, session_id: str, step: int, request: pb.StepRequest,
                     data: bytes, pending: PendingStep, out: Future) -> None:
        try:
            reply = self._channel_step(steps, session_id, request, partial(pending.result, self.timeout_s), data)
            out.ended = time.perf_counter()
            out.set_result(_tree_of(reply, step))
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            out.set_exception(exc)

    @property
    def supports_prepare(self) -> bool:
        """Prepares go over the step channel only, to a server that said it answers them."""
        return self._prepares and self._steps is not None

    def prepare(self, session_id: str, step: int, accepted_tokens: Sequence[int], retrieval: Optional[Retrieval],
                due_s: float) -> Future:
        """base.py's prepare over the step channel: sent now, its answer awaited on a thread of
        this client's (the caller reads the future when the verification ends). No retry over gRPC:
        a failure is the request's DraftError (its fallback), as a step's after its retry."""
        steps = self._steps
        if steps is None:
            raise DraftError("the draft's step channel is gone: no prepares")
        request = prepare_to_proto(session_id, step, accepted_tokens, retrieval, due_s)
        return self._waiters.submit(self._prepare_call, steps, self._stamped(request))

    def _prepare_call(self, steps: StepChannelClient, data: bytes) -> Outcomes:
        try:
            return outcomes_from_proto(pb.Outcomes.FromString(steps.call(data, self.timeout_s)))
        except StepFailed as err:
            raise error_from_status(err.code, err.details, "Prepare", steps.endpoint, self.timeout_s) from err
        except DecodeError as err:
            raise DraftError(f"draft step channel at {steps.endpoint} sent malformed Outcomes") from err

    def close(self, session_id: str) -> None:
        """Best effort, never raises: a failure is logged and the engine carries on."""
        self._drop_stream(session_id)
        try:
            request = pb.CloseSessionRequest(session_id=session_id)
            self._call("CloseSession", request, self.timeout_s)
        except DraftError as exc:
            logger.warning("closing draft session %s failed: %s", session_id, exc)

    def server_health(self) -> DraftHealth:
        reply = self._call("Health", pb.HealthRequest(), self.timeout_s)
        self._learn_endpoint(reply.step_endpoint)
        return DraftHealth(ok=reply.ok, sessions=reply.sessions, model=reply.model)

    def health(self) -> bool:
        try:
            return self.server_health().ok
        except DraftError as exc:
            logger.warning("draft health check failed: %s", exc)
            return False
