"""The EngineClient seam between the HTTP layer and whatever decodes (Router actor, or a fake).

    async generate(request_id, prompt_ids, params) -> AsyncIterator[TokenDelta]
    async abort(request_id) -> None
    async stats() -> dict

`generate` yields deltas of committed token ids in order; the last one carries `finish_reason`
("stop": EOS or a stop token id, "length": max_tokens or the context). A delta may be empty (the
first one acknowledges admission to the queue). Failures are raised as the `EngineError`
subclasses below, whatever transport sits in between.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ddserve.sampling import SamplingParams


@dataclass(frozen=True)
class TokenDelta:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class EngineError(RuntimeError):
    """Base of every error the engine side reports to the HTTP layer."""


class QueueFull(EngineError):
    """The request queue is at capacity; retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # keep retry_after across pickling (Ray re-raises in another process)
        return (QueueFull, (str(self), self.retry_after))


class RequestRejected(EngineError):
    """The request can never run on this engine (e.g. prompt larger than the whole KV pool)."""


class EngineDead(EngineError):
    """A shard died or the engine is otherwise unable to serve (HTTP 503). `retry_after`: the
    seconds until it is expected back (a rebuild under way; HTTP Retry-After), or None."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):  # keep retry_after across pickling (Ray re-raises in another process)
        return (EngineDead, (str(self), self.retry_after))


class EngineClient(ABC):
    @abstractmethod
    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]: ...

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def stats(self) -> dict: ...
