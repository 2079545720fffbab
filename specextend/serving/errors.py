"""Typed serving errors and their one mapping to OpenAI's error JSON and HTTP status.

A replica hands a request's own errors (4xx) back as an item `{"error": body()["error"]}`, which
the ingress turns back into the error with `APIError.from_body` (an exception would be logged by
Serve as an ERROR with a traceback); anything else crosses the DeploymentHandle wrapped in a
RayTaskError, which `api_error` unwraps. Constructors take only the message (and param) so they
pickle.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    status = 500
    type = "internal_error"  # OpenAI's error.type
    headers: dict[str, str] = {}

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    @staticmethod
    def from_body(error: dict) -> "APIError":
        """The error a replica handed back as an item (`body()["error"]`)."""
        cls = next((c for c in _CLIENT_ERRORS if c.status == error.get("code")), APIError)
        return cls(error.get("message", "error"), error.get("param"))


class BadRequestError(APIError):
    status, type = 400, "invalid_request_error"


class ModelNotFoundError(APIError):
    status, type = 404, "not_found_error"


class RequestTimeoutError(APIError):
    status, type = 408, "invalid_request_error"


class PayloadTooLargeError(APIError):
    status, type = 413, "invalid_request_error"


class QueueFullError(APIError):
    status, type = 429, "rate_limit_error"
    headers = {"Retry-After": "1"}


class NotReadyError(APIError):
    status, type = 503, "service_unavailable"


_CLIENT_ERRORS = (BadRequestError, ModelNotFoundError, RequestTimeoutError, PayloadTooLargeError, QueueFullError)


def api_error(exc: BaseException) -> APIError:
    """The APIError an exception from a replica (possibly wrapped by Ray or Serve) stands for."""
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    seen = 0
    while isinstance(exc, RayTaskError) and seen < 8:  # unwrap nested task errors
        exc, seen = exc.cause, seen + 1
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackPressureError):
        return QueueFullError("the server is at its queue limit; retry later")
    return APIError(f"internal error: {type(exc).__name__}: {exc}")
