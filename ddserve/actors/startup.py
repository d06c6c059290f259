"""Starting a replica's engine: reserving the shards' resources, and failures as one line.

A start that fails raises StartupError whose message names the root cause on one line (a shard's
exception type and first message line, or the resources no node offered), so `ddserve serve`
and `serve status` show it without the ~300 lines of nested Ray tracebacks around it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from ddserve.actors.router import RouterConfig


class StartupError(RuntimeError):
    """The replica's engine could not start; the message is one line naming the cause."""


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


async def first_failure(aw: Any) -> Any:
    """Awaits the shards' calls; a failed one raises StartupError naming its root cause."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return await aw
    except RayTaskError as e:
        cause = e.cause if isinstance(e.cause, BaseException) else e
        raise StartupError(f"a shard failed to start: {one_line(cause)}") from None
    except RayActorError as e:
        raise StartupError(f"a shard died while starting: {one_line(e)}") from None


async def reserve_shards(cfg: RouterConfig) -> PlacementGroup:
    """A ready placement group with one bundle per rank (STRICT_PACK on GPUs: one node), or
    StartupError after `cfg.placement_timeout_s` (the group is removed)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

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
