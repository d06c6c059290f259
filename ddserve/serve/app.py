"""The OpenAI-compatible FastAPI app over an EngineClient, and the Ray Serve application builder.

`create_app(engine, model, limits, api_key)` is plain FastAPI (tests drive it in-process against
a fake engine); `build_app(config)` (in `ddserve.serve.deployment`, re-exported here) wraps it in a
Serve deployment whose replica owns one Router actor and its shards.

Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}` (`ddserve.serve.errors`):
400 for bad input (including prompts over `HttpLimits`), 401 for a missing or wrong API key, 404
for an unknown model or URL, 413 for a body over `max_body_bytes`, 429 + Retry-After when the
queue is full, 503 + Retry-After when the engine failed. Prompts are tokenized and outputs
detokenized on worker threads, so a large request never stalls the event loop (other streams,
/health); the app's lifespan shuts those threads down.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddserve.actors.client import EngineClient, EngineDead, EngineError
from ddserve.serve import errors, metrics
from ddserve.serve.errors import engine_api_error, error_body, error_response
from ddserve.serve.guards import ApiKeyGuard, BodyLimit
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
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from ddserve.serve.requests import ApiError, prepare_chat, prepare_completion
from ddserve.serve.textgen import TextStream

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["HttpLimits", "ServedModel", "build_app", "create_app", "engine_api_error"]


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


@dataclass(frozen=True)
class HttpLimits:
    """What one request may cost. Body size and prompt characters are checked before anything
    is tokenized; prompt tokens right after tokenizing, before the engine sees the request.

    max_body_bytes: larger bodies get 413 unread. 8 MiB holds a prompt of `max_prompt_chars`
        ASCII characters plus a 256k-token context as a JSON list of ids, or a 256k-token
        context of CJK text (~300k characters) JSON-escaped as \\uXXXX (6 bytes each); beyond
        that a body only costs memory and parse time.
    max_prompt_chars: a completion prompt, or the message texts of a chat request summed, longer
        than this gets 400 (code string_above_max_length). 2M characters is 8 per token of a
        256k-token context, twice what English text averages, so a prompt that fits the context
        is not refused here; tokenizing 2M characters takes a worker thread ~1-2 s.
    max_prompt_tokens: prompts over this many tokens get 400 (code context_length_exceeded).
        None: the served context length (a prompt must also leave room for one token).
    """

    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_chars: int = 2_000_000
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"HttpLimits.{name} must be at least 1, got {value}")


# Prompt tokenization: long prompts queue behind each other here, never on the event loop.
# Detokenization has its own pool, so streams keep flowing while prompts are tokenized.
TOKENIZE_THREADS, DETOKENIZE_THREADS = 4, 4
OPEN_API = errors.responses  # shorthand for the routes' documented error codes


class _Pool:
    """A thread pool made on first use and shut down by the app's lifespan, so a replica or a
    test that builds many apps keeps no idle threads (a later use makes a new pool)."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads, self._name = threads, name
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
        return self._pool

    def shutdown(self) -> None:
        """Idle threads exit now, busy ones when their task is done; queued tasks are dropped."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def create_app(
    engine: EngineClient,
    model: ServedModel,
    limits: HttpLimits = HttpLimits(),
    api_key: str | None = None,
) -> FastAPI:
    """The app. `api_key`: when set, every path but /health needs `Authorization: Bearer <key>`
    (401 otherwise); None serves without authentication."""
    if api_key == "":  # an unset environment variable must not mean "the empty key"
        raise ValueError("api_key is empty: pass None to serve without a key")
    tokenize = _Pool(TOKENIZE_THREADS, "ddserve-tokenize")
    detokenize = _Pool(DETOKENIZE_THREADS, "ddserve-detokenize")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            tokenize.shutdown()
            detokenize.shutdown()

    app = FastAPI(title="ddserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    counters = metrics.HttpCounters()
    errors.install(app, counters.finish)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, count=counters.finish)
    if api_key is not None:  # outermost: an unauthenticated body is never read
        app.add_middleware(ApiKeyGuard, api_key=api_key, count=counters.finish)
    auth = (401,) if api_key is not None else ()

    async def prepare(fn: Callable[..., T], req: Any) -> T:
        """`prepare_completion` / `prepare_chat` (they tokenize) on the tokenizer pool."""
        call = functools.partial(
            fn,
            req,
            model.name,
            model.tokenizer,
            model.max_model_len,
            model.vocab_size,
            max_prompt_chars=limits.max_prompt_chars,
            max_prompt_tokens=limits.max_prompt_tokens,  # None: the context length
        )
        return await asyncio.get_running_loop().run_in_executor(tokenize.get(), call)

    last_unhealthy = ""  # the cause last logged; "" while healthy

    @app.get("/health", responses=OPEN_API(503))
    async def health() -> Response:
        nonlocal last_unhealthy
        stats = await engine.stats()
        if stats.get("healthy", True):
            last_unhealthy = ""
            return JSONResponse({"status": "ok"})
        detail = str(stats.get("error") or "engine unhealthy")
        if detail != last_unhealthy:  # once per outage and cause: probes poll this
            log.error("unhealthy: %s", detail)
            last_unhealthy = detail
        # retry_after_s: the supervisor's estimate while it rebuilds the engine
        return error_response(errors.engine_unavailable(stats.get("retry_after_s")))

    # /metrics needs the API key too when one is set: queue depth and token counts describe the
    # traffic, which is the key holders' business (scrapers send the Bearer header).
    @app.get("/metrics", responses=OPEN_API(*auth))
    async def get_metrics() -> Response:
        text = metrics.render(counters, await engine.stats())
        return Response(text, media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", responses=OPEN_API(*auth))
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    generation_errors = OPEN_API(400, *auth, 404, 413, 429, 503)

    @app.post("/v1/completions", responses=generation_errors)
    async def completions(req: CompletionRequest) -> Response:
        ids, params, stops = await prepare(prepare_completion, req)
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

    @app.post("/v1/chat/completions", responses=generation_errors)
    async def chat(req: ChatCompletionRequest) -> Response:
        ids, params, stops = await prepare(prepare_chat, req)
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
        stream = TextStream(engine, model.tokenizer, rid, ids, params, stops, detokenize.get())
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
            yield _error_event(engine_api_error(e))
        except Exception:  # noqa: BLE001 - logged; the client gets an error event, not a cut
            log.exception("stream %s failed", stream.request_id)
            status = "failed"
            yield _error_event(errors.server_error())
        finally:
            counters.finish(status, stream.prompt_tokens, stream.completion_tokens)
            await stream.close()

    return app


def _error_event(api: ApiError) -> str:
    """The error the HTTP body would have carried, as an SSE event (the status is already sent)."""
    return f"data: {json.dumps(error_body(api), ensure_ascii=True)}\n\n"


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
