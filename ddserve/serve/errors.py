"""Every HTTP error in OpenAI's body, `{"error": {"message", "type", "param", "code"}}`.

Messages are written for the client: what was wrong with the request, or that the server failed
and when to retry. Internal detail (Ray actor ids, node addresses, tracebacks) goes to the server
log only. `install(app, count)` registers the handlers (validation errors -> 400, starlette's
404/405/..., unexpected exceptions -> a generic 500) and makes the published OpenAPI schema list
the codes the server really sends instead of FastAPI's 422.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddserve.actors.client import EngineError, QueueFull, RequestRejected
from ddserve.serve.protocol import ErrorResponse, quoted
from ddserve.serve.requests import ApiError

log = logging.getLogger(__name__)

ENGINE_FAILED = "The model server failed; retry later."
ENGINE_RESTARTING = "The model server is restarting after a failure; retry after {} s."
SERVER_ERROR = "The server had an error while processing your request; retry later."
ENGINE_RETRY_AFTER_S = 5  # a dead engine is replaced by Serve (or rebuilt) in seconds, not ms
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error object: the HTTP error's body, and an SSE error event's data."""
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def error_response(err: ApiError) -> Response:
    # ASCII JSON: a message quoting client text with a lone surrogate still serializes
    return Response(
        json.dumps(error_body(err), ensure_ascii=True),
        status_code=err.status,
        headers=err.headers,
        media_type="application/json",
    )


def engine_unavailable(expected: float | None = None) -> ApiError:
    """503 + Retry-After. `expected`: seconds until a rebuild under way should finish, or None
    (the engine failed; Serve or the rebuild replaces it in seconds)."""
    retry = ENGINE_RETRY_AFTER_S if expected is None else max(1, round(expected))
    message = ENGINE_FAILED if expected is None else ENGINE_RESTARTING.format(retry)
    return ApiError(
        503,
        message,
        type="service_unavailable",
        code="service_unavailable",
        headers={"Retry-After": str(retry)},
    )


def server_error() -> ApiError:
    return ApiError(500, SERVER_ERROR, type="server_error", code="server_error")


def engine_api_error(e: EngineError) -> ApiError:
    """The HTTP error for an engine-side failure (see ddserve.actors.client), in user terms."""
    if isinstance(e, QueueFull):
        retry = max(1, round(e.retry_after))
        return ApiError(
            429,
            f"The server is at capacity (request queue full); retry after {retry} s.",
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(e, RequestRejected):  # the engine's own words about this request
        log.info("request rejected by the engine: %s", e)
        return ApiError(
            400,
            f"The request cannot run on this server: {_first_line(str(e))}",
            code="request_rejected",
        )
    log.error("engine failure (%s): %s", type(e).__name__, e)
    # EngineDead.retry_after: seconds until a rebuild under way is expected to finish, or None
    return engine_unavailable(getattr(e, "retry_after", None))


def _first_line(text: str, limit: int = 300) -> str:
    line = _ANSI.sub("", text).strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _field_path(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].role` from pydantic's loc, dropping union-member tags such as `str`."""
    names = [p for p in loc if p != "body"]
    if not names:
        return None
    path = str(names[0])
    for p in names[1:]:
        if isinstance(p, int):
            path += f"[{p}]"
        elif re.fullmatch(r"[a-z_]+", p) and p not in ("str", "int", "list", "dict", "bool"):
            path += f".{p}"
        else:
            break
    return path


def validation_error(exc: RequestValidationError) -> ApiError:
    """A 400 naming the first offending field (`param`: its top-level name)."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg")
        return ApiError(400, f"Malformed JSON body: {why}.")
    path = _field_path(tuple(first.get("loc", ())))
    if path is None:  # the body as a whole
        if isinstance(first.get("input"), bytes):
            msg = "The request body must be JSON, sent with Content-Type: application/json."
        elif first.get("type") == "missing":
            msg = "The request body is empty: expected a JSON object."
        else:
            msg = "The request body must be a JSON object."
        return ApiError(400, msg)
    param = path.split(".")[0].split("[")[0]
    same = [e for e in errors if _field_path(tuple(e.get("loc", ()))) == path]
    # in a union (prompt: a string or ids), our own check says more than every branch's type
    same = [e for e in same if e.get("type") == "value_error"] or same
    msgs = dict.fromkeys(str(e.get("msg", "")).removeprefix("Value error, ") for e in same)
    return ApiError(400, f"Invalid value for '{path}': {'; or '.join(msgs)}", param=param)


def _http_error(request: Request, exc: StarletteHTTPException) -> ApiError:
    where = quoted(f"{request.method} {request.url.path}", 80)
    if exc.status_code == 404:
        return ApiError(404, f"Invalid URL: {where}.", code="unknown_url")
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return ApiError(
            405,
            f"Method not allowed: {where} (allowed: {allow}).",
            code="method_not_allowed",
            headers=exc.headers,
        )
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, str(exc.detail), type=type_, headers=exc.headers)


def install(app: FastAPI, count: Callable[[str], None]) -> None:
    """Register the error handlers; `count(status)` feeds the requests_total metric."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        count("invalid")
        return error_response(validation_error(exc))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        count("rejected" if exc.status == 429 else "invalid" if exc.status < 500 else "failed")
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(_http_error(request, exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        count("failed")
        return error_response(server_error())

    _publish_real_codes(app)


ERROR_MODEL = {"model": ErrorResponse}
ERROR_CODES = {
    400: "Invalid request: a field is wrong, or the prompt is too long.",
    401: "Missing or incorrect API key (only when the server has one).",
    404: "Unknown model.",
    413: "Request body larger than the server accepts.",
    429: "The request queue is full; retry after the Retry-After header's seconds.",
    503: "The model server failed or is restarting; retry after Retry-After seconds.",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: these error codes, each with OpenAI's error body."""
    return {c: {**ERROR_MODEL, "description": ERROR_CODES[c]} for c in codes}


def _publish_real_codes(app: FastAPI) -> None:
    """The schema without FastAPI's 422 entries: validation errors are answered with 400."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
