"""The OpenAI-compatible FastAPI app over an EngineClient, and the Ray Serve application builder.

`create_app(engine, model)` is plain FastAPI (tests drive it in-process against a fake engine);
`build_app(config)` (in `ddserve.serve.deployment`, re-exported here) wraps it in a Serve
deployment whose replica owns one Router actor and its shards.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input,
404 for an unknown model, 429 + Retry-After when the queue is full, 503 when the engine is dead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddserve.actors.client import EngineClient, EngineDead, EngineError, QueueFull, RequestRejected
from ddserve.serve import metrics
from ddserve.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from ddserve.serve.requests import ApiError, prepare_chat, prepare_completion
from ddserve.serve.textgen import TextStream


class TextTokenizer(Protocol):
    def encode(
        self, text: str, add_bos: bool = False, allow_special: bool | None = None
    ) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str: ...


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    tokenizer: TextTokenizer
    vocab_size: int | None = None  # the model's (embedding rows); ids must fit it too


def error_response(err: ApiError) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code)
    )
    return JSONResponse(body.model_dump(), status_code=err.status, headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """OpenAI-style (message, param) from pydantic errors: param is the top-level field."""
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        return f"Malformed JSON body: {errors[0].get('msg')}", None

    def field(e: dict) -> str | None:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        return loc[0] if loc else None

    param = field(errors[0])
    msgs = list(dict.fromkeys(e.get("msg", "") for e in errors if field(e) == param))
    return f"Invalid value for '{param or 'body'}': {'; or '.join(msgs)}", param


def create_app(engine: EngineClient, model: ServedModel) -> FastAPI:
    app = FastAPI(title="ddserve", docs_url=None, redoc_url=None)
    counters = metrics.HttpCounters()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        counters.finish("invalid")
        message, param = _validation_message(exc)
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        counters.finish(
            "rejected" if exc.status == 429 else "invalid" if exc.status < 500 else "failed"
        )
        return error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        stats = await engine.stats()
        if not stats.get("healthy", True):
            msg = stats.get("error") or "engine unhealthy"
            return error_response(ApiError(503, msg, type="service_unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        text = metrics.render(counters, await engine.stats())
        return Response(text, media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        ids, params, stops = prepare_completion(
            req, model.name, model.tokenizer, model.max_model_len, model.vocab_size
        )
        rid = new_id("cmpl")
        stream = await _start(rid, ids, params, stops)
        if req.stream:
            return _sse(_completion_chunks(stream, rid, req.include_usage), stream)
        text, reason = await _collect(stream)
        return JSONResponse(
            CompletionResponse(
                id=rid,
                created=now(),
                model=model.name,
                choices=[CompletionChoice(text=text, finish_reason=reason)],
                usage=Usage.of(stream.prompt_tokens, stream.completion_tokens),
            ).model_dump()
        )

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        ids, params, stops = prepare_chat(
            req, model.name, model.tokenizer, model.max_model_len, model.vocab_size
        )
        rid = new_id("chatcmpl")
        stream = await _start(rid, ids, params, stops)
        if req.stream:
            return _sse(_chat_chunks(stream, rid, req.include_usage), stream)
        text, reason = await _collect(stream)
        return JSONResponse(
            ChatCompletionResponse(
                id=rid,
                created=now(),
                model=model.name,
                choices=[
                    ChatChoice(message=ChatResponseMessage(content=text), finish_reason=reason)
                ],
                usage=Usage.of(stream.prompt_tokens, stream.completion_tokens),
            ).model_dump()
        )

    async def _start(rid: str, ids: list[int], params: Any, stops: list[str]) -> TextStream:
        stream = TextStream(engine, model.tokenizer, rid, ids, params, stops)
        try:
            await stream.start()
        except EngineError as e:
            raise engine_api_error(e) from e
        return stream

    async def _collect(stream: TextStream) -> tuple[str, str | None]:
        parts, reason = [], None
        try:
            async for d in stream:
                parts.append(d.text)
                reason = d.finish_reason
        except EngineError as e:  # after the admission ack, e.g. rejected by the shards
            raise engine_api_error(e) from e
        except BaseException:
            counters.finish("cancelled", stream.prompt_tokens, stream.completion_tokens)
            raise
        counters.finish("ok", stream.prompt_tokens, stream.completion_tokens)
        return "".join(parts), reason

    def _completion_chunks(stream: TextStream, rid: str, usage: bool) -> AsyncIterator[str]:
        def chunk(text: str, reason: str | None) -> BaseModelLike:
            return CompletionResponse(
                id=rid,
                created=now(),
                model=model.name,
                choices=[CompletionChoice(text=text, finish_reason=reason)],
            )

        def usage_chunk(u: Usage) -> BaseModelLike:
            return CompletionResponse(id=rid, created=now(), model=model.name, choices=[], usage=u)

        return _events(stream, chunk, usage_chunk if usage else None, first=None)

    def _chat_chunks(stream: TextStream, rid: str, usage: bool) -> AsyncIterator[str]:
        def chunk(text: str | None, reason: str | None, role: str | None = None) -> BaseModelLike:
            delta = ChatDelta(role=role, content=text)
            return ChatCompletionChunk(
                id=rid,
                created=now(),
                model=model.name,
                choices=[ChatChunkChoice(delta=delta, finish_reason=reason)],
            )

        def usage_chunk(u: Usage) -> BaseModelLike:
            return ChatCompletionChunk(id=rid, created=now(), model=model.name, choices=[], usage=u)

        return _events(
            stream, chunk, usage_chunk if usage else None, first=chunk("", None, "assistant")
        )

    async def _events(
        stream: TextStream,
        chunk: Callable[[str, str | None], BaseModelLike],
        usage_chunk: Callable[[Usage], BaseModelLike] | None,
        first: BaseModelLike | None,
    ) -> AsyncIterator[str]:
        status = "cancelled"
        try:
            if first is not None:
                yield _data(first)
            async for d in stream:
                yield _data(chunk(d.text, d.finish_reason))
            if usage_chunk is not None:
                yield _data(usage_chunk(Usage.of(stream.prompt_tokens, stream.completion_tokens)))
            yield "data: [DONE]\n\n"
            status = "ok"
        except EngineError as e:  # the HTTP status is already sent: an error event instead
            status = "failed" if isinstance(e, EngineDead) else "invalid"
            api = engine_api_error(e)
            err = ErrorInfo(message=api.message, type=api.type, code=api.status)
            yield f"data: {json.dumps({'error': err.model_dump()})}\n\n"
        finally:
            counters.finish(status, stream.prompt_tokens, stream.completion_tokens)
            await stream.close()

    return app


def engine_api_error(e: EngineError) -> ApiError:
    """The HTTP error for an engine-side failure (see ddserve.actors.client)."""
    if isinstance(e, QueueFull):
        retry = str(max(1, round(e.retry_after)))
        return ApiError(429, str(e), type="rate_limit_exceeded", headers={"Retry-After": retry})
    if isinstance(e, RequestRejected):
        return ApiError(400, str(e))
    return ApiError(503, str(e), type="service_unavailable")


class BaseModelLike(Protocol):
    def model_dump_json(self, **kw: Any) -> str: ...


def _data(obj: BaseModelLike) -> str:
    return f"data: {obj.model_dump_json(exclude_none=False)}\n\n"


def _sse(events: AsyncIterator[str], stream: TextStream) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Request-Id": stream.request_id},
    )


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve application builder (`serve run ddserve.serve.app:build_app model=...`)."""
    from ddserve.serve.deployment import build_app as build

    return build(args)
