"""Streaming client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

One call to `send_request` sends one streaming request and returns its `RequestResult`
timeline: start, the arrival of every chunk that carries generated text, end, and the token
counts from the final `usage` chunk (`stream_options.include_usage`). It never raises for a
server-side problem: HTTP errors, error events, malformed chunks and a missing `data: [DONE]`
become `RequestResult.error`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

import httpx

from loadtest.datasets import Prompt
from loadtest.metrics import RequestResult

EndpointKind = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no trailing /v1)
    model: str
    endpoint: EndpointKind = "completions"
    ignore_eos: bool = False
    temperature: float = 0.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.endpoint]


class SSEDecoder:
    """Feeds text lines of an event stream; returns each complete event's data, else None."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:  # a blank line ends the event
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data at the end of a stream that lacks the final blank line."""
        return self.feed("")


def build_body(target: Target, prompt: Prompt) -> dict:
    """The JSON body of one streaming request."""
    body: dict = {
        "model": target.model,
        "max_tokens": prompt.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict, endpoint: EndpointKind) -> str:
    """Generated text carried by one stream chunk (choice 0); '' if none."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, target: Target, prompt: Prompt) -> RequestResult:
    """Send one streaming request and record its timeline (see the module docstring)."""
    res = RequestResult(start=time.perf_counter(), end=0.0, prompt_len=prompt.prompt_len)
    n_chunks = 0
    done = False
    try:
        async with client.stream("POST", target.url, json=build_body(target, prompt)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")[:200]
                res.error = f"HTTP {resp.status_code}: {body}"
                return res
            decoder = SSEDecoder()
            async for line in resp.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event: {json.dumps(chunk['error'])[:200]}"
                    return res
                res.request_id = res.request_id or chunk.get("id")
                if chunk_text(chunk, target.endpoint):
                    res.chunk_times.append(time.perf_counter())
                    n_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.output_len = int(usage.get("completion_tokens", 0))
                    res.prompt_len = int(usage.get("prompt_tokens", res.prompt_len))
        if not done:
            res.error = "stream ended without data: [DONE]"
        elif not res.usage_reported:
            res.output_len = n_chunks
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        res.end = time.perf_counter()
    return res


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by GET /v1/models."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
