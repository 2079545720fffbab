"""The ZeroMQ step channel's frames, shared by its server and client (docs/architecture.md, "Wire
protocol").

The channel carries DraftService's own messages: a serialized StepRequest out, a serialized
DraftTree back, one multipart message each way:

    request  DEALER -> ROUTER   [TAG, token, request id, StepRequest]
    reply    ROUTER -> DEALER   [request id, status, body]

TAG names the protocol and its version. `token` is the per-replica token (rpc/auth.py; empty
without one), checked in constant time before anything else is read. The request id is the
client's (8 bytes), echoed unchanged, so that a reply to a request the client gave up on is
recognised and dropped. `status` is one byte, the number of a gRPC status code (0 = OK), so that
errors map to DraftError subclasses exactly as Step's do (errors.py); `body` is the DraftTree when
OK, else the error's details (UTF-8).
"""

from __future__ import annotations

import grpc

TAG = b"specextend.v1.step"
MAX_REQUEST_ID_BYTES = 32
# a step is well under 1 KB (5 B a token id, a few dozen ids); a larger message is not a step: the
# server's socket drops the connection that sent it (zmq.MAXMSGSIZE)
MAX_MESSAGE_BYTES = 1 << 20

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_frame(code: grpc.StatusCode) -> bytes:
    return bytes((code.value[0],))


def status_code(frame: bytes) -> grpc.StatusCode:
    """The status a reply's status frame carries (UNKNOWN for anything else)."""
    return _CODES.get(frame[0], grpc.StatusCode.UNKNOWN) if len(frame) == 1 else grpc.StatusCode.UNKNOWN


def tcp_bind_address(host: str) -> str:
    """ZeroMQ's address for "any free port on host" (IPv6 literals in brackets)."""
    return f"tcp://[{host}]:*" if ":" in host and not host.startswith("[") else f"tcp://{host}:*"


def is_ipv6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")
