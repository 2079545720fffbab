"""The draft channel's authentication: a per-replica token (docs/architecture.md, "Wire protocol").

The replica makes a random token (`new_token`) and hands it to its draft actor at start; the draft
server accepts a call only when its `authorization` metadata is `Bearer <token>`, compared in
constant time, and answers anything else UNAUTHENTICATED before the call reaches the servicer.
The client sends the metadata on every call (`call_metadata`); a StepStream carries it once, when
the stream opens, and is checked then. A step over the ZeroMQ step channel carries the token in its
message's header (`frame_token`, zmq_wire.py), checked by `token_matches` before the step is read
(zmq_server.py). The token never appears in a log line or a status message.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Optional

import grpc

from specextend.v1 import draft_pb2 as pb

HEADER = "authorization"  # gRPC metadata keys are lowercase
SCHEME = "Bearer "
TOKEN_BYTES = 32  # 256 bits, URL-safe base64 (43 characters)
UNAUTHENTICATED_DETAILS = "missing or wrong draft channel token"


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def call_metadata(token: Optional[str]) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends on every call (none without a token)."""
    return ((HEADER, SCHEME + token),) if token else ()


def _deny(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


def _deny_stream(requests, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
    yield  # a generator, as a stream-stream handler is; never reached


def frame_token(token: Optional[str]) -> bytes:
    """The token in a ZeroMQ step's header (zmq_wire.py); empty without a token."""
    return token.encode() if token else b""


def token_matches(given: bytes, expected: bytes) -> bool:
    """Constant-time comparison of a ZeroMQ step's token with the server's."""
    return hmac.compare_digest(given, expected)


# requests are left as bytes (never deserialized); a streaming method is denied by a streaming handler
_DENIED = grpc.unary_unary_rpc_method_handler(_deny)
_DENIED_STREAM = grpc.stream_stream_rpc_method_handler(_deny_stream)
_SERVICE = pb.DESCRIPTOR.services_by_name["DraftService"]
STREAMING_METHODS = frozenset(f"/{_SERVICE.full_name}/{m.name}" for m in _SERVICE.methods if m.client_streaming)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the draft channel token must not be empty")
        self._expected = (SCHEME + token).encode()

    def intercept_service(self, continuation, handler_call_details):
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER:
                given = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(given, self._expected):
            return continuation(handler_call_details)
        return _DENIED_STREAM if handler_call_details.method in STREAMING_METHODS else _DENIED
