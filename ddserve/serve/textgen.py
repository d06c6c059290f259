"""One request's token stream turned into text: incremental detokenization, stop strings, usage.

`TextStream` is what both the streaming and the non-streaming endpoints iterate. It owns the
request id on the engine side: when the consumer stops early (stop string, client disconnect,
error) it aborts the engine request so the stream's KV slots are freed at the next step.
Detokenization runs on `executor` (None: the event loop's default pool), never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass

from ddserve.actors.client import EngineClient, TokenDelta
from ddserve.sampling import SamplingParams
from ddserve.serve.detok import Decoder, IncrementalDetokenizer, StopChecker


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None


class TextStream:
    """Async iterator of TextDelta; `completion_tokens` counts tokens consumed so far.

    Call `start()` first: it waits for the engine's first delta, so admission errors (queue full,
    dead engine) surface before any HTTP response has started.
    """

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Decoder,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        executor: Executor | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finished = False  # the final TextDelta was produced
        self._engine_done = False  # the engine reported a finish_reason (nothing to abort)
        self._engine = engine
        self._deltas = engine.generate(request_id, prompt_ids, params)
        self._first: TokenDelta | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = StopChecker(stops)
        self._executor = executor

    async def start(self) -> None:
        self._first = await anext(self._deltas)

    async def __aiter__(self) -> AsyncIterator[TextDelta]:
        assert self._first is not None, "call start() first"
        try:
            delta: TokenDelta | None = self._first
            loop = asyncio.get_running_loop()
            while delta is not None:
                out = None
                if delta.token_ids or delta.finish_reason is not None:
                    out = await loop.run_in_executor(self._executor, self._consume, delta)
                if out is not None:
                    yield out
                if self.finished:
                    return
                delta = await anext(self._deltas, None)
            raise RuntimeError("engine stream ended without a finish_reason")
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the engine request unless it already finished (idempotent)."""
        self.finished = True
        if not self._engine_done:
            self._engine_done = True
            await self._engine.abort(self.request_id)
        aclose = getattr(self._deltas, "aclose", None)
        if aclose is not None:
            await aclose()

    def _consume(self, delta: TokenDelta) -> TextDelta | None:
        # Token by token, so a stop string ends the count at the token that completes it: usage
        # is then what autoregressive decoding reports, however many tokens a step committed.
        text = ""
        for t in delta.token_ids:
            self.completion_tokens += 1
            text += self._stop.push(self._detok.push([t]))
            if self._stop.stopped:
                break
        reason = delta.finish_reason
        self._engine_done = self._engine_done or reason is not None
        if reason is not None and not self._stop.stopped:
            text += self._stop.push(self._detok.flush())
            text += self._stop.flush()
        if self._stop.stopped:
            reason = "stop"  # a stop string ends the request; close() aborts the engine side
        if reason is not None:
            self.finished = True
            return TextDelta(text, reason)
        return TextDelta(text) if text else None
