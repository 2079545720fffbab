"""The ZeroMQ step channel's messages, shared by its server and client (docs/architecture.md, "Wire
protocol").

The channel carries DraftService's own messages: a serialized StepRequest out, a serialized
DraftTree back, each in one ZeroMQ frame behind a small fixed header (one frame, not one per
field: a multipart message costs about 50 us more per round trip on the 2-core host):

    request  DEALER -> ROUTER   TAG (18 B) | request id (u64) | token length (u16) | token | StepRequest
    reply    ROUTER -> DEALER   request id (u64) | status (u8) | DraftTree, or the error's details (UTF-8)

Integers little-endian. TAG names the protocol and its version. The token is the per-replica token
(rpc/auth.py; empty without one), checked in constant time before the StepRequest is read. The
request id is the client's, echoed unchanged, so that a reply to a request the client gave up on
is recognised and dropped. `status` is the number of a gRPC status code (0 = OK), so that errors
map to DraftError subclasses exactly as Step's do (errors.py).
"""

from __future__ import annotations

import struct

import grpc

TAG = b"specextend.v1.step"
REQUEST_HEAD = struct.Struct("<18sQH")  # TAG, request id, token length; then the token, the StepRequest
REPLY_HEAD = struct.Struct("<QB")  # request id, status; then the body
MAX_TOKEN_BYTES = 1024  # a token fits `Authorization: Bearer <token>` (config.header_token)
# a step is well under 1 KB (5 B a token id, a few dozen ids); a larger message is not a step: the
# server's socket drops the connection that sent it (zmq.MAXMSGSIZE)
MAX_MESSAGE_BYTES = 1 << 20

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class BadRequest(ValueError):
    """A frame that is not a step request of this protocol; `request_id` is 0 when unknown."""

    def __init__(self, request_id: int = 0) -> None:
        super().__init__(f"not a {TAG.decode()} request")
        self.request_id = request_id


def encode_request(token: bytes, request_id: int, step_request: bytes) -> bytes:
    return REQUEST_HEAD.pack(TAG, request_id, len(token)) + token + step_request


def decode_request(frame: bytes) -> tuple[int, bytes, bytes]:
    """frame -> (request id, token, StepRequest bytes); raises BadRequest."""
    if len(frame) < REQUEST_HEAD.size:
        raise BadRequest()
    tag, request_id, token_len = REQUEST_HEAD.unpack_from(frame)
    end = REQUEST_HEAD.size + token_len
    if tag != TAG or token_len > MAX_TOKEN_BYTES or len(frame) < end:
        raise BadRequest(request_id if tag == TAG else 0)
    return request_id, frame[REQUEST_HEAD.size:end], frame[end:]


def encode_reply(request_id: int, code: grpc.StatusCode, body: bytes) -> bytes:
    return REPLY_HEAD.pack(request_id, code.value[0]) + body


def decode_reply(frame: bytes) -> tuple[int, grpc.StatusCode, bytes]:
    """frame -> (request id, status, body); a frame too short for a reply has request id -1."""
    if len(frame) < REPLY_HEAD.size:
        return -1, grpc.StatusCode.UNKNOWN, b""
    request_id, code = REPLY_HEAD.unpack_from(frame)
    return request_id, _CODES.get(code, grpc.StatusCode.UNKNOWN), frame[REPLY_HEAD.size:]


def tcp_bind_address(host: str) -> str:
    """ZeroMQ's address for "any free port on host" (IPv6 literals in brackets)."""
    return f"tcp://[{host}]:*" if ":" in host and not host.startswith("[") else f"tcp://{host}:*"


def is_ipv6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")
