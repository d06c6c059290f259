"""EngineClient over a Router actor handle: Ray transport in, EngineError subclasses out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ddserve.actors.client import EngineClient, EngineDead, EngineError, TokenDelta
from ddserve.actors.router import Router, RouterConfig, StartupError
from ddserve.sampling import SamplingParams


async def start_router(cfg: RouterConfig, name: str | None = None) -> tuple[Any, dict]:
    """Reserve the shards' resources, then create the Router actor (it places, loads and warms
    up its shards); returns (handle, model info). On failure nothing is left behind: the Router
    and the placement group are gone. The placement group belongs to the caller, so it also
    goes when the caller (a Serve replica) dies."""
    pg = await reserve_shards(cfg)
    opts: dict[str, Any] = {"num_cpus": cfg.shard_cpus, "max_concurrency": 10_000}
    if name:
        opts.update(name=name, namespace="ddserve")
    router = ray.remote(Router).options(**opts).remote(cfg, pg)
    try:
        info = await router.start.remote()
    except BaseException:
        ray.kill(router)
        remove_placement_group(pg)
        raise
    return router, info


async def reserve_shards(cfg: RouterConfig) -> PlacementGroup:
    """A ready placement group with one bundle per rank (STRICT_PACK on GPUs: one node), or
    StartupError after `cfg.placement_timeout_s` (the group is removed)."""
    gpu = cfg.shard.device.startswith("cuda")
    bundle = {"CPU": cfg.shard_cpus, **({"GPU": 1} if gpu else {})}
    strategy = "STRICT_PACK" if gpu else "PACK"
    pg = placement_group([bundle] * cfg.shard.world_size, strategy=strategy)
    try:
        await asyncio.wait_for(pg.ready(), cfg.placement_timeout_s)
    except BaseException as e:
        remove_placement_group(pg)
        if not isinstance(e, asyncio.TimeoutError):
            raise
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise StartupError(
            f"no node offered {cfg.shard.world_size} x {bundle} ({strategy}) within "
            f"{cfg.placement_timeout_s:g} s; free now: {free}"
        ) from None
    return pg


def _translate(e: BaseException) -> BaseException:
    if isinstance(e, RayTaskError) and isinstance(e.cause, EngineError):
        return e.cause
    if isinstance(e, RayActorError):
        return EngineDead(f"the router actor died: {e}")
    return e


class RayEngineClient(EngineClient):
    def __init__(self, router: Any) -> None:
        self.router = router

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        gen = self.router.generate.options(num_returns="streaming").remote(
            request_id, prompt_ids, params
        )
        finished = False
        try:
            async for ref in gen:
                try:
                    delta = await ref
                except Exception as e:  # noqa: BLE001 - re-raised translated
                    raise _translate(e) from None
                finished = delta.finish_reason is not None
                yield delta
        except (RayActorError, RayTaskError) as e:
            raise _translate(e) from None
        finally:
            if not finished:
                try:
                    ray.cancel(gen)
                except Exception:  # noqa: BLE001 - best effort; abort() below is the real cancel
                    pass
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        try:
            await self.router.abort.remote(request_id)
        except RayActorError:
            pass  # nothing left to abort

    async def stats(self) -> dict:
        try:
            return await self.router.stats.remote()
        except RayActorError as e:
            return {"healthy": False, "error": f"the router actor died: {e}"}
