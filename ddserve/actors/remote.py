"""The Ray side of a replica's engine: a Router and its shards started (and released) as one
group, and EngineClient over the Router's handle: Ray transport in, EngineError subclasses out.

Every call into the Router is bounded: a router that has died fails at once (Ray knows), and
one that does not answer fails after a timeout, so no caller waits on a lost actor.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from ddserve.actors.client import EngineClient, EngineDead, EngineError, TokenDelta
from ddserve.actors.router import Router, RouterConfig
from ddserve.actors.startup import one_line, reserve_shards
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 30.0  # a live router queues a request (the first, empty delta) in milliseconds
CALL_TIMEOUT_S = 5.0  # abort, stats, shutdown


@dataclass
class RouterGroup:
    """A started Router with what it holds: the placement group of its shards (owned by the
    process that called `start_router`, so it outlives the Router) and the shard handles."""

    router: Any
    pg: Any
    info: dict
    shards: list

    def __post_init__(self) -> None:
        self.client = RayEngineClient(self.router)

    async def wait_failed(self) -> str:
        """Returns, in user terms, why the group stopped serving: its step loop failed (a shard
        died or failed) or the Router itself died. The Ray details go to the log."""
        try:
            return await self.router.wait_failed.remote()
        except RayActorError as e:
            log.error("the router actor died: %s", one_line(e))
            return "the engine's router process died"

    async def release(self) -> None:
        """Stops the Router and kills it and its shards, and removes the placement group. A
        Router that does not answer within CALL_TIMEOUT_S is killed without its shutdown (its
        shards die with it: the Router owns them)."""
        try:
            await asyncio.wait_for(self.router.shutdown.remote(), CALL_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError):
            pass  # dead already, or stuck: killed below
        for actor in (self.router, *self.shards):
            ray.kill(actor)
        remove_placement_group(self.pg)


async def start_router(cfg: RouterConfig, name: str | None = None) -> RouterGroup:
    """Reserve the shards' resources, then create the Router actor (it places, loads and warms
    up its shards). On failure (or cancellation) nothing is left behind: the Router and the
    placement group are gone. The placement group belongs to the caller, so it also goes when
    the caller (a Serve replica) dies."""
    pg = await reserve_shards(cfg)
    opts: dict[str, Any] = {"num_cpus": cfg.shard_cpus, "max_concurrency": 10_000}
    if name:
        opts.update(name=name, namespace="ddserve")
    router = ray.remote(Router).options(**opts).remote(cfg, pg)
    try:
        info = await router.start.remote()
        shards = await router.shards.remote()
    except BaseException:
        ray.kill(router)
        remove_placement_group(pg)
        raise
    return RouterGroup(router, pg, info, shards)


def _translate(e: BaseException) -> BaseException:
    if isinstance(e, RayTaskError) and isinstance(e.cause, EngineError):
        return e.cause
    if isinstance(e, RayActorError):  # its details are logged once, by RouterGroup.wait_failed
        return EngineDead("the engine's router process died")
    return e


class RayEngineClient(EngineClient):
    """`generate` submits to the Router and reads the request's tokens from this client's one
    subscription per event loop (`_Subscription`: a `Router.subscribe` stream whose items carry
    every request's tokens of a step). `stats` raises EngineDead when the Router has died and
    TimeoutError when it does not answer within CALL_TIMEOUT_S; `abort` never raises."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self._subs: dict[asyncio.AbstractEventLoop, _Subscription] = {}

    def _subscription(self) -> _Subscription:
        loop = asyncio.get_running_loop()
        sub = self._subs.get(loop)
        if sub is None or sub.closed:
            for old in [lp for lp in self._subs if lp.is_closed()]:  # loops that have ended
                del self._subs[old]
            sub = self._subs[loop] = _Subscription(self.router)
        return sub

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        sub = self._subscription()
        queue = sub.register(request_id)
        finished = False
        submit = None
        try:
            try:  # queued: the empty ack
                submit = self.router.submit.remote(request_id, prompt_ids, params, sub.id)
                await asyncio.wait_for(submit, ACK_TIMEOUT_S)
                submit = None  # acknowledged: an abort now finds the request
            except asyncio.TimeoutError:
                raise EngineDead(f"the engine did not queue the request within "
                                 f"{ACK_TIMEOUT_S:g} s") from None  # fmt: skip
            except (RayActorError, RayTaskError) as e:
                raise _translate(e) from None
            yield TokenDelta()
            while not finished:
                tokens, reason = [], None
                item = await queue.get()
                while True:  # coalesce what is already there
                    if isinstance(item, BaseException):
                        raise item
                    tokens += item.token_ids
                    reason = item.finish_reason
                    if reason is not None or queue.empty():
                        break
                    item = queue.get_nowait()
                finished = reason is not None
                yield TokenDelta(tokens, reason)
        finally:
            sub.unregister(request_id)
            if submit is not None:  # not acknowledged (cancelled, timed out): it must not run,
                _cancel(submit)  # as an abort could overtake it (a large prompt travels apart)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.router.abort.remote(request_id), CALL_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError):
            pass  # nothing left to abort, or the router is stuck (its failure is seen elsewhere)

    async def stats(self) -> dict:
        try:
            return await asyncio.wait_for(self.router.stats.remote(), CALL_TIMEOUT_S)
        except RayActorError as e:
            raise _translate(e) from None


class _Subscription:
    """One event loop's `Router.subscribe` stream: a task reads its items and puts each
    request's into that request's queue. When the stream fails (the Router died) every
    registered request gets the error, and the next `generate` opens a new subscription."""

    def __init__(self, router: Any) -> None:
        self.id = uuid.uuid4().hex
        self.closed = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._gen = router.subscribe.options(num_returns="streaming").remote(self.id)
        self._task = asyncio.get_running_loop().create_task(self._read())

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue of this request's TokenDeltas (or its error), before it is submitted."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        error: EngineDead = EngineDead("the engine stream ended")
        try:
            async for ref in self._gen:
                for rid, item in await ref:
                    queue = self._queues.get(rid)
                    if queue is not None:  # else: the request's reader has gone (aborted)
                        queue.put_nowait(item)
        except (RayActorError, RayTaskError) as e:
            translated = _translate(e)
            if isinstance(translated, EngineDead):
                error = translated
        except Exception as e:  # noqa: BLE001 - every request learns the stream is gone
            log.exception("the engine stream failed")
            error = EngineDead(f"the engine stream failed: {one_line(e)}")
        except asyncio.CancelledError:  # the loop is ending
            error = EngineDead("the engine stream was closed")
            raise
        finally:
            self.closed = True
            _cancel(self._gen)  # the Router's side ends too (and aborts what it still holds)
            for queue in self._queues.values():  # each its own: a raise grows its traceback
                queue.put_nowait(EngineDead(str(error), error.retry_after))


def _cancel(ref: Any) -> None:
    """Best effort: a call that has not run will not; a running streaming call is closed."""
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - already finished, or the actor is gone
        pass
