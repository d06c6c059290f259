"""A fake EngineClient and byte tokenizer for HTTP-layer tests (no Ray, no model).

The fake "model" repeats the prompt: generated token k is prompt_ids[k % len(prompt_ids)], so a
test can compute the expected text without the code under test. Tokens arrive in small chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn

from ddserve.actors.client import EngineClient, EngineDead, QueueFull, TokenDelta
from ddserve.sampling import SamplingParams

EOS = 257
VOCAB = 260


class ByteTok:
    """Token id == byte value; 256 = BOS, 257 = EOS (both decode to nothing)."""

    vocab_size = VOCAB
    eos_token_id = EOS

    def encode(
        self, text: str, add_bos: bool = False, allow_special: bool | None = None
    ) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class SlowTok(ByteTok):
    """ByteTok whose encode, and whose decode of any id list holding `slow_id`, block the calling
    thread (as a long prompt or a pathological decode does); counts encode calls."""

    def __init__(self, encode_s: float = 0.0, decode_s: float = 0.0, slow_id: int = 90) -> None:
        self.encode_s, self.decode_s, self.slow_id = encode_s, decode_s, slow_id
        self.encodes = 0

    def encode(
        self, text: str, add_bos: bool = False, allow_special: bool | None = None
    ) -> list[int]:
        self.encodes += 1
        time.sleep(self.encode_s)
        return super().encode(text, add_bos, allow_special)

    def decode(self, ids: list[int]) -> str:
        if self.slow_id in ids:
            time.sleep(self.decode_s)
        return super().decode(ids)


def expected_tokens(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    out = []
    for k in range(params.max_tokens):
        t = prompt_ids[k % len(prompt_ids)]
        out.append(t)
        if t in params.stop_token_ids or (t == EOS and not params.ignore_eos):
            break
    return out


class FakeEngine(EngineClient):
    def __init__(self, chunk: int = 3, delay: float = 0.0) -> None:
        self.chunk, self.delay = chunk, delay
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.queue_full = False
        self.dead: str | None = None
        self.die_after_tokens: int | None = None
        self.retry_after_s: float | None = None  # stats' estimate while "rebuilding"

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if self.dead:
            raise EngineDead(self.dead)
        if self.queue_full:
            raise QueueFull("request queue is full (2 waiting)", retry_after=2.0)
        self.active.add(request_id)
        try:
            yield TokenDelta()
            toks = expected_tokens(prompt_ids, params)
            for i in range(0, len(toks), self.chunk):
                await asyncio.sleep(self.delay)
                if request_id not in self.active:
                    return
                if self.die_after_tokens is not None and i >= self.die_after_tokens:
                    raise EngineDead("shard 1 died")
                part = toks[i : i + self.chunk]
                done = i + self.chunk >= len(toks)
                reason = None
                if done:
                    reason = (
                        "length"
                        if len(toks) == params.max_tokens
                        and toks[-1] not in (EOS, *params.stop_token_ids)
                        else "stop"
                    )
                yield TokenDelta(part, reason)
            self.finished.append(request_id)
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id not in self.finished:
            self.aborted.append(request_id)
        self.active.discard(request_id)

    async def stats(self) -> dict:
        return {
            "healthy": self.dead is None,
            "error": self.dead,
            "queue_depth": 0,
            "active_streams": len(self.active),
            "kv_slots_used": 10 * len(self.active),
            "kv_slots_total": 1000,
            **({} if self.retry_after_s is None else {"retry_after_s": self.retry_after_s}),
        }


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(5)
