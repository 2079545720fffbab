"""The HTTP API key (docs/architecture.md, "Serving surface").

With a key configured, every path but `/health` and `/metrics` needs `Authorization: Bearer <key>`
(compared in constant time) and answers 401 in OpenAI's error JSON otherwise, before routing, so
an unauthenticated client learns nothing from validation errors either. The key is the app
argument `api_key`, else the environment variable SPECEXTEND_API_KEY as the ingress's process
sees it (the way to keep it out of Serve's dashboard); with neither, the API is open. The key is
held as a pydantic SecretStr and never logged, echoed or exported.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Callable, Optional

from fastapi.responses import JSONResponse
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import SecretStr
from starlette.datastructures import Headers

from specextend.config import header_token

log = logging.getLogger(__name__)

ENV = "SPECEXTEND_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key
MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization "
           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


def resolve_key(argument: Optional[SecretStr], environ=os.environ) -> Optional[SecretStr]:
    """The key in force: the argument, else $SPECEXTEND_API_KEY (surrounding whitespace, such as a
    Secret file's trailing newline, dropped); None when neither is set (the API is open). Logs
    which, never the key."""
    if argument is not None:
        log.info("API key required on the HTTP API (from the api_key argument)")
        return argument
    value = environ.get(ENV, "").strip()
    if not value:
        log.warning("no API key (api_key or %s): the HTTP API is open to anyone who can reach it", ENV)
        return None
    if not header_token(value):
        raise ValueError(f"{ENV} must be 1 to 1024 printable ASCII characters without spaces")
    log.info("API key required on the HTTP API (from %s)", ENV)
    return SecretStr(value)


def error_body(message: str) -> dict:
    """OpenAI's answer to a missing or wrong key (HTTP 401)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


def check(authorization: Optional[str], key: SecretStr) -> Optional[str]:
    """None when `authorization` carries `key`, else the error message to answer with."""
    scheme, given = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not given:
        return MISSING
    if hmac.compare_digest(given.encode(), key.get_secret_value().encode()):
        return None
    return INCORRECT


class APIKeyMiddleware:
    """ASGI middleware; `key()` returns the key in force (None: no authentication)."""

    def __init__(self, app, key: Callable[[], Optional[SecretStr]]) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        key = self.key() if scope["type"] == "http" else None
        if key is None or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        message = check(Headers(scope=scope).get("authorization"), key)
        if message is None:
            return await self.app(scope, receive, send)
        reply = JSONResponse(error_body(message), status_code=401,
                             headers={"WWW-Authenticate": 'Bearer realm="specextend"'})
        await reply(scope, receive, send)


def _route_path(scope) -> str:
    """The path below the app's route prefix."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
