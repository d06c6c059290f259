"""A Router that cannot start fails with its cause in one line and leaves nothing reserved: no
placement group, no shard, no CPU or GPU held (a failed replica's retries used to pile up
placement groups until nothing could be placed); a group rebuilt after a shard died leaves only
the new group behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.actors.startup import StartupError
from ddserve.engine.config import EngineConfig
from ddserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

CPUS = 1.0


@pytest.fixture(scope="module")
def ray_one_cpu():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=CPUS, num_gpus=0, include_dashboard=False,
             logging_level="ERROR")  # fmt: skip
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_int4_model_dir):
    return tiny_int4_model_dir  # a random make-tiny model (8 heads): fast, and any weights do


def _config(model_dir, tp: int, num_slots: int = 256, **kw) -> RouterConfig:
    engine = EngineConfig(num_slots=num_slots, budget=4, dtype="float32", max_streams=2,
                          graph_buckets=(1, 2))  # fmt: skip
    spec = ShardSpec(model_path=str(model_dir), world_size=tp,
                     drafter_path=str(model_dir / "drafter"), engine=engine)  # fmt: skip
    return RouterConfig(shard=spec, control="fanout", **kw)


def _released() -> bool:
    """Every placement group removed and every CPU free again (within a few seconds)."""
    import ray

    for _ in range(100):
        groups = ray.util.placement_group_table().values()
        if all(g["state"] == "REMOVED" for g in groups):
            if ray.available_resources().get("CPU", 0) >= CPUS:
                return True
        time.sleep(0.1)
    return False


def test_shards_that_cannot_load_fail_start_and_release_everything(ray_one_cpu, model_dir):
    from ddserve.actors.remote import start_router

    cfg = _config(model_dir, tp=3, warmup=False)  # 8 heads over 3 ranks
    with pytest.raises(StartupError, match="num_attention_heads = 8 is not divisible by .* 3"):
        asyncio.run(start_router(cfg))
    assert _released()


def test_resources_no_node_offers_time_out_and_release_the_group(ray_one_cpu, model_dir):
    from ddserve.actors.remote import start_router

    cfg = _config(model_dir, tp=2, shard_cpus=0.9, placement_timeout_s=1.0)  # 1.8 of 1 CPU
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"no node offered 2 x \{'CPU': 0.9\} .* within 1 s"):
        asyncio.run(start_router(cfg))
    assert time.monotonic() - t0 < 15
    assert _released()


def test_warmup_runs_every_batch_size_and_leaves_no_stream(ray_one_cpu, model_dir):
    from ddserve.actors.remote import RayEngineClient, start_router

    group = asyncio.run(start_router(_config(model_dir, tp=1)))
    try:
        stats = asyncio.run(RayEngineClient(group.router).stats())
        assert group.info["speculative"] and stats["warmup_shapes"] == 2  # 1, 2 streams, budget 4
        assert stats["kv_slots_used"] == stats["active_streams"] == stats["steps_total"] == 0
    finally:
        asyncio.run(group.release())
    assert _released()


def test_a_group_rebuilt_after_a_shard_is_killed_leaves_only_the_new_one(ray_one_cpu, model_dir):
    """kill -9 of a shard of an idle group: the heartbeat finds it, the supervisor releases the
    old router, shards and placement group and starts new ones, which serve."""
    import ray
    from ray.exceptions import RayActorError

    from ddserve.actors.remote import start_router
    from ddserve.actors.supervisor import RebuildPolicy, SupervisedEngine

    cfg = _config(model_dir, tp=2, warmup=False)

    async def main() -> None:
        engine = SupervisedEngine(lambda _: start_router(cfg), RebuildPolicy(attempts=1))
        await engine.start()
        old = engine.group
        os.kill(await old.shards[1].pid.remote(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.rebuilds == 0:
            assert engine.state != "failed" and time.monotonic() < deadline
            await asyncio.sleep(0.2)
        for actor in (old.router, *old.shards):
            with pytest.raises(RayActorError):
                await actor.__ray_ready__.remote()
        live = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        assert len(live) == 1
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        toks = [t async for d in engine.generate("r", [256, 65], params) for t in d.token_ids]
        assert len(toks) == 4
        await engine.close()

    asyncio.run(main())
    assert _released()


def test_a_killed_router_ends_every_stream_in_flight_with_engine_dead(ray_one_cpu, model_dir):
    """kill -9 of the Router under two open streams (both read through the client's one
    subscription): each ends with EngineDead within seconds, none hangs, and a new request on
    the same client fails the same way at once."""
    import ray

    from ddserve.actors.client import EngineDead
    from ddserve.actors.remote import start_router

    group = asyncio.run(start_router(_config(model_dir, tp=1, num_slots=4096, warmup=False)))
    params = SamplingParams(max_tokens=1500, ignore_eos=True)  # neither ends before the kill

    async def read(rid: str, first: asyncio.Event) -> BaseException | None:
        try:
            async for d in group.client.generate(rid, [256, 65, 66], params):
                if d.token_ids:
                    first.set()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            return e
        return None

    async def main() -> tuple[list, float, BaseException | None]:
        firsts = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(read(f"k{i}", ev)) for i, ev in enumerate(firsts)]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in firsts)), 60)
        os.kill(await group.router.pid.remote(), signal.SIGKILL)
        t0 = time.monotonic()
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        waited = time.monotonic() - t0
        later = await read("after", asyncio.Event())
        return errors, waited, later

    try:
        errors, waited, later = asyncio.run(main())
        assert all(isinstance(e, EngineDead) for e in errors), errors
        assert waited < 10, waited
        assert isinstance(later, EngineDead), later
    finally:
        for actor in group.shards:
            ray.kill(actor)
        ray.util.remove_placement_group(group.pg)
    assert _released()


def test_a_closed_subscription_aborts_its_requests_and_refuses_new_ones(ray_one_cpu, model_dir):
    """At the Router's own API: a subscriber that closes its stream mid-request (no abort sent)
    frees the request's stream and KV slots, and a later submit for it raises EngineDead."""
    import ray

    from ddserve.actors.client import EngineDead
    from ddserve.actors.remote import start_router

    group = asyncio.run(start_router(_config(model_dir, tp=1, num_slots=4096, warmup=False)))
    router, params = group.router, SamplingParams(max_tokens=1500, ignore_eos=True)

    async def main() -> tuple[dict, dict, BaseException | None]:
        gen = router.subscribe.options(num_returns="streaming").remote("s1")
        await router.submit.remote("r1", [256, 65, 66], params, "s1")
        items = await (await gen.__anext__())  # the first step's tokens
        assert [rid for rid, _ in items] == ["r1"]
        during = await router.stats.remote()
        ray.cancel(gen)  # the subscriber leaves without aborting r1
        for _ in range(100):  # the cancel's command reports the freed slots after it runs
            after = await router.stats.remote()
            if after["active_streams"] == after["kv_slots_used"] == 0:
                break
            await asyncio.sleep(0.1)
        try:
            await router.submit.remote("r2", [256, 65], params, "s1")
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            return during, after, e
        return during, after, None

    try:
        during, after, refused = asyncio.run(main())
        assert during["active_streams"] == 1
        assert after["active_streams"] == 0 and after["kv_slots_used"] == 0, after
        assert refused is not None and isinstance(refused.cause, EngineDead), refused
    finally:
        asyncio.run(group.release())
    assert _released()
