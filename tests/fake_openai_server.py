"""A small fake OpenAI-compatible streaming server for testing the load generator.

It streams `/v1/completions` and `/v1/chat/completions` as the OpenAI API does (SSE chunks, a
final `usage` chunk with empty `choices` when `stream_options.include_usage` is set, then
`data: [DONE]`), and mimics speculative decoding: after a prefill delay, each "step" commits 1-3
tokens and sends them in one chunk; a step takes longer the more streams are active, as a
batched engine's does. It counts steps and committed tokens on `/metrics` under the
ddserve names, and logs every request (id, token counts) so tests can check the client against
what the server really sent. A prompt containing `<fail>` gets HTTP 500; `<fail-midstream>` gets
an error event after the first chunk. Prompt tokens are counted per word (`tokens="words"`, a
BPE-like count; a chat message adds 2) or as ddserve's byte-level tokenizer counts them
(`tokens="bytes"`: BOS + UTF-8 bytes of the prompt, or of the rendered chat template).
`report_usage=False` leaves the usage chunk out; `http_requests` counts every request received.

    with FakeOpenAIServer() as srv:
        ...  # srv.url is http://127.0.0.1:<free port>
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class FakeOpenAIServer:
    def __init__(
        self,
        model: str = "fake-model",
        prefill_s: float = 0.004,
        step_s: float = 0.002,
        tokens: str = "words",
        report_usage: bool = True,
    ):
        self.model = model
        self.tokens = tokens
        self.report_usage = report_usage
        self.http_requests = 0
        self.prefill_s = prefill_s
        self.step_s = step_s
        self.log: list[dict] = []  # one row per finished request
        self.steps = 0
        self.committed = 0
        self.requests_ok = 0
        self.requests_failed = 0
        self.active = 0  # streams being generated now
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ---- token generation -------------------------------------------------------------------
    def _plan(self, body: dict, prompt_words: list[str]) -> list[int]:
        """Tokens committed at each step; the total is the completion length."""
        rng = random.Random(" ".join(prompt_words) + str(body.get("max_tokens")))
        max_tokens = int(body.get("max_tokens") or 16)
        n_out = max_tokens if body.get("ignore_eos") else rng.randint(1, max_tokens)
        plan = []
        while sum(plan) < n_out:
            plan.append(min(rng.choice((1, 2, 3)), n_out - sum(plan)))
        return plan

    def _chunk(self, base: dict, chat: bool, text: str, finish: str | None) -> str:
        choice: dict = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"content": text} if text else {}} if chat else {"text": text})
        return _sse({**base, "choices": [choice]})

    async def _steps(self, chat: bool, base: dict, plan: list[int], fail_mid: bool):
        """One chunk per step; a step's time grows with the number of active streams."""
        await asyncio.sleep(self.prefill_s)
        for i, k in enumerate(plan):
            if i:
                await asyncio.sleep(self.step_s * (1 + 0.5 * (self.active - 1)))
            self.steps += 1
            self.committed += k
            yield self._chunk(base, chat, "".join(f" t{i}_{j}" for j in range(k)), None)
            if fail_mid:
                yield _sse({"error": {"message": "injected failure", "type": "server_error"}})
                return

    async def _stream(self, chat: bool, body: dict, prompt_tokens: int, plan: list[int], rid: str):
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model}
        fail_mid = "<fail-midstream>" in json.dumps(body)
        if chat:  # OpenAI's first chat chunk carries the role and no text
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            yield _sse({**base, "choices": [role]})
        self.active += 1
        try:
            async for chunk in self._steps(chat, base, plan, fail_mid):
                yield chunk
        finally:
            self.active -= 1
        if fail_mid:
            self.requests_failed += 1
            return
        yield self._chunk(base, chat, "", "length")
        n_out = sum(plan)
        if self.report_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out}
            usage["total_tokens"] = prompt_tokens + n_out
            yield _sse({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
        self.requests_ok += 1
        row = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": n_out}
        self.log.append({**row, "steps": len(plan)})

    async def _generate(self, request: Request, chat: bool):
        body = await request.json()
        if chat:
            messages = body.get("messages") or []
            words = [w for m in messages for w in str(m.get("content", "")).split()]
            prompt_tokens = len(words) + 2 * len(messages)  # a chat template's role markers
            turn = "<|im_start|>{}\n{}<|im_end|>\n"  # the rendered chat template
            text = "".join(turn.format(m.get("role"), m.get("content")) for m in messages)
            text += "<|im_start|>assistant\n"
        else:
            text = str(body.get("prompt", ""))
            words = text.split()
            prompt_tokens = len(words)
        if self.tokens == "bytes":
            prompt_tokens = 1 + len(text.encode("utf-8"))
        if "<fail>" in words:
            self.requests_failed += 1
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:12]
        plan = self._plan(body, words)
        if body.get("stream"):
            stream = self._stream(chat, body, prompt_tokens, plan, rid)
            return StreamingResponse(stream, media_type="text/event-stream")
        chunks = [c async for c in self._stream(chat, body, prompt_tokens, plan, rid)]
        return JSONResponse({"id": rid, "n_chunks": len(chunks)})  # enough for these tests

    def metrics_text(self) -> str:
        return (
            "# HELP ddserve_stream_steps_total Decode steps, counted per stream.\n"
            "# TYPE ddserve_stream_steps_total counter\n"
            f"ddserve_stream_steps_total {self.steps}\n"
            # batched steps: one per stream step here, so that a client that divides by this
            # instead of the per-stream counter is caught (the figure would come out the same
            # only if every step had one stream)
            f"ddserve_steps_total {max(self.steps // 2, 1) if self.steps else 0}\n"
            "# TYPE ddserve_committed_tokens_total counter\n"
            f"ddserve_committed_tokens_total {self.committed}\n"
            f"ddserve_generation_tokens_total {self.committed}\n"
            f'ddserve_requests_total{{status="ok"}} {self.requests_ok}\n'
            f'ddserve_requests_total{{status="error"}} {self.requests_failed}\n'
        )

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def count_requests(request: Request, call_next):
            self.http_requests += 1
            return await call_next(request)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/metrics", response_class=PlainTextResponse)
        async def metrics() -> str:
            return self.metrics_text()

        return app

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> FakeOpenAIServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
