"""A replica's engine that outlives its tensor-parallel group: when a shard or the Router dies, it
rebuilds the group in place (a new Router and new shards, the weights loaded again, a new
communicator) while every request gets a fast EngineDead with `retry_after` (HTTP 503 with
Retry-After), never a wait on a dead actor.

    serving --(the group fails)--> rebuilding --(a start succeeds)--> serving
                                        \\--(RebuildPolicy.attempts used up)--> failed

A failed replica reports unhealthy, so Serve replaces it. The group is whatever `start` returns
(remote.RouterGroup over Ray; tests pass fakes): it serves requests through `client`, reports its
failure through `wait_failed` and gives back its actors and resources in `release`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from ddserve.actors.client import EngineClient, EngineDead, TokenDelta
from ddserve.actors.startup import one_line
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)


class Group(Protocol):
    info: dict
    client: EngineClient

    async def wait_failed(self) -> str: ...
    async def release(self) -> None: ...


@dataclass(frozen=True)
class RebuildPolicy:
    """attempts: starts tried after a failure before giving up (0: never rebuild). Attempt n > 1
    waits backoff_s * 2^(n-2) first, at most backoff_max_s. A group that failed less than
    stable_s after it started counts on from the attempts before it (a crash loop ends too).
    An attempt taking longer than max(4 x the first start's time, min_start_timeout_s) fails."""

    attempts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    min_start_timeout_s: float = 120.0


class SupervisedEngine(EngineClient):
    def __init__(self, start: Callable[[int], Awaitable[Group]], policy: RebuildPolicy) -> None:
        """`start(generation)` starts a group (generation 1, 2, ...: a fresh actor name each)."""
        self._start, self.policy = start, policy
        self._group: Group | None = None
        self.state = "starting"  # serving | rebuilding | failed
        self._cause = ""  # what failed, in user terms
        self._since = 0.0  # monotonic time the state began
        self._attempt_since = 0.0  # monotonic time the current rebuild attempt began (back-off)
        self._backoff_s = 0.0  # the current attempt's back-off
        self._generation = 0
        self._attempts = 0  # in the current streak of failures
        self._start_s = 0.0  # the last successful start's duration: the Retry-After estimate
        self._first_start_s = 0.0
        self.rebuilds = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def group(self) -> Group | None:
        """The serving group (None while rebuilding or failed)."""
        return self._group

    async def start(self) -> dict:
        """The first group; its failure is the replica's (raised)."""
        group = await self._start_group(timeout=None)
        self._first_start_s = self._start_s
        self._serve(group)
        return group.info

    # ---- EngineClient ----------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        group = self._serving()
        try:
            async with aclosing(group.client.generate(request_id, prompt_ids, params)) as deltas:
                async for delta in deltas:
                    yield delta
        except EngineDead as e:  # the watcher sees the group's failure and starts the rebuild
            raise EngineDead(str(e), self._retry_after()) from None

    async def abort(self, request_id: str) -> None:
        if self.state == "serving" and self._group is not None:
            await self._group.client.abort(request_id)

    async def stats(self) -> dict:
        extra = {"rebuilds_total": self.rebuilds, "engine_state": self.state}
        group = self._group
        if self.state != "serving" or group is None:
            if self.state == "rebuilding":
                extra["retry_after_s"] = self._retry_after()
            return {"healthy": False, "error": self._unavailable(), **extra}
        try:
            return {**await group.client.stats(), **extra}
        except (EngineDead, asyncio.TimeoutError) as e:
            return {"healthy": False, "error": str(e) or "the engine did not answer", **extra}

    async def check_health(self) -> None:
        """Raises when Serve should replace the replica: the rebuilds gave up, or the Router is
        alive but does not answer (stuck). A rebuild under way counts as healthy: the replica
        repairs itself sooner than Serve could replace it (a new replica loads the same weights
        after Serve has noticed and started it), a replacement would throw the rebuild away,
        and the rebuild is bounded (attempts with back-off, each with a timeout), after which
        the state is `failed` and this check raises."""
        if self.state == "failed":
            raise RuntimeError(self._unavailable())
        group = self._group
        if self.state != "serving" or group is None:
            return
        try:
            await group.client.stats()
        except EngineDead:
            pass  # the Router died: its watcher starts the rebuild
        except asyncio.TimeoutError:
            raise RuntimeError("the engine's router does not answer") from None

    async def close(self) -> None:
        """Stops the watcher and any rebuild, and releases the group (the replica is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        group, self._group, self.state = self._group, None, "failed"
        self._cause = "the replica is shutting down"
        if group is not None:
            await group.release()

    # ---- the state machine ------------------------------------------------------------------
    def _serving(self) -> Group:
        if self.state != "serving" or self._group is None:
            raise EngineDead(self._unavailable(), self._retry_after())
        return self._group

    def _serve(self, group: Group) -> None:
        self._group, self.state, self._since = group, "serving", time.monotonic()
        self._spawn(self._watch(group))

    async def _watch(self, group: Group) -> None:
        try:
            cause = await group.wait_failed()
        except Exception as e:  # noqa: BLE001 - whatever broke the wait, the group is gone
            log.error("waiting on the tensor-parallel group failed: %s", one_line(e))
            cause = "the engine failed"
        if group is not self._group or self.state != "serving":
            return
        if time.monotonic() - self._since >= self.policy.stable_s:
            self._attempts = 0  # it served a while: a new streak
        log.error("the tensor-parallel group failed: %s; rebuilding it", cause)
        self._group, self._cause = None, cause
        self.state, self._since = "rebuilding", time.monotonic()
        self._attempt_since, self._backoff_s = self._since, 0.0  # until the first attempt
        self._spawn(self._rebuild(group))

    async def _rebuild(self, old: Group) -> None:
        try:
            await old.release()
        except Exception as e:  # noqa: BLE001 - what it held goes when its owner does anyway
            log.error("releasing the failed group: %s", one_line(e))
        p = self.policy
        timeout = max(4 * self._first_start_s, p.min_start_timeout_s)
        while self._attempts < p.attempts:
            self._attempts += 1
            self._attempt_since = time.monotonic()
            self._backoff_s = 0.0
            if self._attempts > 1:
                self._backoff_s = min(p.backoff_s * 2 ** (self._attempts - 2), p.backoff_max_s)
                await asyncio.sleep(self._backoff_s)
            log.warning("rebuild attempt %d of %d", self._attempts, p.attempts)
            try:
                group = await self._start_group(timeout)
            except Exception as e:  # noqa: BLE001 - any start failure: retry, then give up
                log.error("rebuild attempt %d of %d failed: %s", self._attempts, p.attempts,
                          one_line(e))  # fmt: skip
                continue
            self.rebuilds += 1
            down_s = time.monotonic() - self._since
            log.warning("the tensor-parallel group is serving again, %.1f s after the failure "
                        "(start %.1f s)", down_s, self._start_s)  # fmt: skip
            self._serve(group)
            return
        log.error("giving up after %d rebuild attempts: reporting unhealthy", self._attempts)
        self.state, self._since = "failed", time.monotonic()

    async def _start_group(self, timeout: float | None) -> Group:
        self._generation += 1
        t0 = time.monotonic()
        group = await asyncio.wait_for(self._start(self._generation), timeout)
        self._start_s = time.monotonic() - t0
        return group

    def _retry_after(self) -> float:
        """Seconds until the engine is expected back (at least 1): while rebuilding, the current
        attempt's back-off and the last successful start's duration, less the time the attempt
        has run; otherwise a start's duration."""
        if self.state != "rebuilding":
            return max(1.0, self._start_s)
        elapsed = time.monotonic() - self._attempt_since
        return max(1.0, self._backoff_s + self._start_s - elapsed)

    def _unavailable(self) -> str:
        if self.state == "rebuilding":
            return f"{self._cause}; the engine is restarting"
        if self.state == "failed" and self._cause:
            return f"{self._cause}; the engine could not be restarted"
        return "the engine is not running"

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
