"""gRPC client side of the draft: the DraftBackend the target's (synchronous) decode loop calls.

Every call carries a deadline; failures become DraftError subclasses (errors.py), on which the
engine falls back to plain decoding. A Step that hit DEADLINE_EXCEEDED or UNAVAILABLE is sent
once more with the same step number: the server applies a step number once (base.py's contract),
so a first attempt that did reach the draft is not applied twice.

Steps go over one StepStream call per session (stream.py), opened with the session; a step that
failed on it is sent once more on a new stream, as above. A server without StepStream gets unary
Steps (docs/architecture.md, "Wire protocol").
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import grpc

from specextend.draft.base import DraftBackend, DraftError, DraftSessionParams, DraftTree, Retrieval, TreeBound
from specextend.rpc.auth import call_metadata
from specextend.rpc.convert import params_to_proto, step_to_proto, tree_from_proto
from specextend.rpc.errors import RETRYABLE, STREAM_RETRYABLE, error_from_rpc, error_from_status
from specextend.rpc.stream import SessionStream, StreamFailed
from specextend.v1 import draft_pb2 as pb
from specextend.v1 import draft_pb2_grpc

logger = logging.getLogger(__name__)

# Messages are small (a step is well under 1 KB; TCP_NODELAY is gRPC's default), so latency is
# all that matters: no gRPC-level retries (Step retries itself, once), keepalive pings to notice a
# dead draft node between steps, and a short reconnect backoff so a restarted server is found soon.
CHANNEL_OPTIONS = (
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


@dataclass(frozen=True)
class DraftHealth:
    ok: bool
    sessions: int  # sessions open on the server
    model: str  # the draft model's name


class GrpcDraftBackend(DraftBackend):
    """DraftBackend over DraftService at `address` ("host:port"); safe to share between threads.

    timeout_s bounds Step, CloseSession and Health; open_timeout_s bounds OpenSession, which
    includes the draft's prefill of the whole prompt. `token` is the server's (rpc/auth.py),
    sent on every call. `stream=False` sends every step as a unary Step."""

    def __init__(
        self, address: str, timeout_s: float = 10.0, open_timeout_s: float = 300.0, *,
        token: Optional[str] = None, stream: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.open_timeout_s = open_timeout_s
        self.streaming = stream  # turned off for good by a server without StepStream
        self._metadata = call_metadata(token)
        self._lock = threading.Lock()  # guards the (address, channel, stub) triple and the streams
        self._address = address
        self._channel: Optional[grpc.Channel] = None
        self._stub: Optional[draft_pb2_grpc.DraftServiceStub] = None
        self._streams: dict[str, SessionStream] = {}  # session id -> its StepStream
        self.reconnect(address)

    @property
    def address(self) -> str:
        return self._address

    def reconnect(self, address: str) -> None:
        """Dials `address` (e.g. a restarted draft actor's); calls in flight on the old one fail."""
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        with self._lock:
            old, self._channel = self._channel, channel
            self._address, self._stub = address, draft_pb2_grpc.DraftServiceStub(channel)
            streams, self._streams = self._streams, {}
        self._close_old(old, streams)

    def shutdown(self) -> None:
        """Closes the channel; later calls raise DraftError (close() still does not)."""
        with self._lock:
            old, self._channel, self._stub = self._channel, None, None
            streams, self._streams = self._streams, {}
        self._close_old(old, streams)

    @staticmethod
    def _close_old(channel: Optional[grpc.Channel], streams: dict[str, SessionStream]) -> None:
        for stream in streams.values():  # their sessions' next steps open streams on the new channel
            stream.close()
        if channel is not None:
            channel.close()

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
        request.timeout_ms = math.ceil(self.timeout_s * 1e3)  # the server's bound on the step
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

    def open(self, session_id: str, prompt_ids: Sequence[int], params: DraftSessionParams) -> None:
        request = pb.OpenSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, config=params_to_proto(params)
        )
        reply = self._call("OpenSession", request, self.open_timeout_s)
        if reply.prompt_tokens != len(prompt_ids):
            raise DraftError(
                f"draft received {reply.prompt_tokens} of {len(prompt_ids)} prompt tokens"
            )
        if self.streaming:  # opened now, off the first step's path
            self._session_stream(session_id)

    def step(
        self,
        session_id: str,
        step: int,
        accepted_tokens: Sequence[int],
        retrieval: Optional[Retrieval] = None,
        bound: Optional[TreeBound] = None,
    ) -> DraftTree:
        request = step_to_proto(session_id, step, accepted_tokens, retrieval, bound)
        if self.streaming:
            reply = self._stream_step(session_id, request)
        else:
            reply = self._call("Step", request, self.timeout_s, attempts=2)
        tree = tree_from_proto(reply)
        if tree.step != step:
            raise DraftError(f"draft answered step {step} with the tree of step {tree.step}")
        return tree

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
        return DraftHealth(ok=reply.ok, sessions=reply.sessions, model=reply.model)

    def health(self) -> bool:
        try:
            return self.server_health().ok
        except DraftError as exc:
            logger.warning("draft health check failed: %s", exc)
            return False
