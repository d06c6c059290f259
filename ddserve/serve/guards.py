"""ASGI middleware that rejects a request before the app reads or parses it.

- `ApiKeyGuard`: with a key configured, every path except `/health` needs one
  `Authorization: Bearer <key>` header (the scheme in any case, RFC 7235; the key compared in
  constant time), else 401 in OpenAI's shape.
- `BodyLimit`: a body over `max_bytes` is answered 413 without being parsed. A Content-Length
  over the limit is refused before a byte is read; a chunked body is counted while it arrives and
  refused as soon as it passes the limit. The accepted body is handed to the app from a buffer,
  then `receive` is the server's again (the app still sees the client disconnect). Open paths
  take no body: they go to the app unread (a POST to `/health` gets its 405 unread).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ddserve.serve.errors import error_response
from ddserve.serve.requests import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials (GET only)


class ApiKeyGuard:
    def __init__(self, app: App, api_key: str, count: Callable[[str], None]) -> None:
        self.app, self._key, self._count = app, api_key.encode(), count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(given) == 1 and self._matches(given[0]):
            return await self.app(scope, receive, send)
        self._count("unauthorized")
        if not given:
            message = (
                "You didn't provide an API key. Send it in an Authorization header using Bearer "
                "auth (Authorization: Bearer YOUR_KEY)."
            )
        elif len(given) > 1:
            message = "Send one Authorization header, not several."
        else:
            message = "Incorrect API key provided."
        err = ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error_response(err)(scope, receive, send)

    def _matches(self, value: bytes) -> bool:
        scheme, _, key = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.lstrip(b" "), self._key)


class BodyLimit:
    def __init__(self, app: App, max_bytes: int, count: Callable[[str], None]) -> None:
        self.app, self.max_bytes, self._count = app, max_bytes, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._count("invalid")
        err = ApiError(
            413,
            f"The request body is larger than this server accepts ({self.max_bytes} bytes).",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await error_response(err)(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the app routes on: without the root path a proxy mounted it under."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
