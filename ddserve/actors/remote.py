"""EngineClient over a Router actor handle: Ray transport in, EngineError subclasses out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group

from ddserve.actors.client import EngineClient, EngineDead, EngineError, TokenDelta
from ddserve.actors.router import Router, RouterConfig
from ddserve.actors.startup import reserve_shards
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
