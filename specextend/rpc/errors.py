"""The one mapping between gRPC status codes and the DraftError hierarchy (server and client).

    server: backend exception --status_for--> (code, details) --abort--> wire
    client: wire --grpc.RpcError--> error_from_rpc --> DraftError subclass

    DraftSessionNotFound  <->  NOT_FOUND
    DraftStepOutOfOrder   <->  FAILED_PRECONDITION
    ValueError             ->  INVALID_ARGUMENT      (bad config or ids; client sees DraftError)
    anything else          ->  INTERNAL              (client sees DraftError)
    DEADLINE_EXCEEDED, UNAVAILABLE and every other code -> DraftError with the address and cause
"""

from __future__ import annotations

import grpc

from specextend.draft.base import DraftError, DraftSessionNotFound, DraftStepOutOfOrder

# Transport failures after which repeating an idempotent call (Step, by step number) may succeed.
RETRYABLE = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
# ... and for a step on a StepStream, retried on a new stream: a stream the server cancelled too
# (a server stopping cancels the calls it has open, idle streams included)
STREAM_RETRYABLE = RETRYABLE | {grpc.StatusCode.CANCELLED}

_TYPED = {
    grpc.StatusCode.NOT_FOUND: DraftSessionNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: DraftStepOutOfOrder,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Server side: the status code and details a backend exception is sent as."""
    for code, cls in _TYPED.items():
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def error_from_rpc(err: grpc.RpcError, method: str, address: str, timeout_s: float) -> DraftError:
    """Client side: the DraftError a failed call raises (chain the RpcError with `from err`)."""
    return error_from_status(err.code(), err.details(), method, address, timeout_s)


def error_from_status(code: grpc.StatusCode, details: str, method: str, address: str, timeout_s: float) -> DraftError:
    """The DraftError of a call (or of one step of a stream) that ended with `code`."""
    cls = _TYPED.get(code)
    if cls is not None:
        return cls(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DraftError(f"draft {method} at {address} exceeded its {timeout_s:g} s deadline")
    if code == grpc.StatusCode.UNAVAILABLE:
        return DraftError(f"draft server at {address} is unavailable ({method}): {details}")
    return DraftError(f"draft {method} at {address} failed with {code.name}: {details}")
