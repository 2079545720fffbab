"""Request body limits of the ingress: an ASGI middleware (docs/architecture.md, *Serving surface*).

Ray Serve's HTTP proxy (uvicorn) sets no body size limit and no read deadline, so the ingress does:
a body longer than `max_request_bytes` (by its Content-Length, or counted as it arrives) is a 413,
and a body that has not fully arrived within `request_read_timeout_s` (a slow client, or one that
sends less than its Content-Length) is a 408; both in OpenAI's error JSON. The body is read once
here and replayed to the app. After the body, a failing `receive` (Serve cancels it when the
client goes away) reads as a disconnect, so a streaming response ends quietly. The ingress sets
the limits: `limits()` returns those in force (the ingress passes a function that reads its own,
as for the API key: Serve runs a copy of the FastAPI app, so the app object the ingress sees is not
the one serving).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from specextend.serving.errors import APIError, BadRequestError, PayloadTooLargeError, RequestTimeoutError

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    read_timeout_s: float



class _Disconnected(Exception):
    pass


async def _read_body(receive: Receive, max_bytes: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(f"the request body exceeds the limit of {max_bytes} bytes", "body")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _declared_length(scope: dict, max_bytes: int) -> None:
    """Refuses a body by its Content-Length before reading it."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if not value.isdigit():
                raise BadRequestError("invalid Content-Length header", "body")
            if int(value) > max_bytes:
                raise PayloadTooLargeError(f"the request body ({int(value)} bytes) exceeds the limit of "
                                           f"{max_bytes} bytes", "body")


class BodyLimitMiddleware:
    def __init__(self, app: Callable, limits: Callable[[], Optional[BodyLimits]]) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limits = self.limits()
        if limits is None:
            await self.app(scope, receive, send)
            return
        try:
            _declared_length(scope, limits.max_bytes)
            body = await asyncio.wait_for(_read_body(receive, limits.max_bytes), limits.read_timeout_s)
        except asyncio.TimeoutError:
            err: APIError = RequestTimeoutError(
                f"the request body did not arrive within {limits.read_timeout_s:g} s", "body")
            await err.response()(scope, receive, send)
            return
        except APIError as err:
            await err.response()(scope, receive, send)
            return
        except _Disconnected:
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:  # what follows the body: the disconnect
                try:
                    return await receive()
                except Exception:  # noqa: BLE001 - Serve cancelled the receive: the client is gone
                    return {"type": "http.disconnect"}
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
