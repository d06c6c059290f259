"""The Router actor without Serve: DDTree decoding (tiny DFlash drafter) over 2 gloo shards driven
by the fan-out control path, KV-bound admission, the queue bound and cancellation.

Expected tokens come from a tp=1 ModelRunner's plain autoregressive greedy decoding.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from ddserve.actors.client import QueueFull, RequestRejected
from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.engine.config import EngineConfig
from ddserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

BUDGET = 6
SLOTS = 150  # two 40-token streams fit (each reserves prompt + max_tokens + budget + 1), not 3


@pytest.fixture(scope="module")
def model_dir(tiny_int4_model_dir):
    return tiny_int4_model_dir  # a random make-tiny model: fast, and any weights do here


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tmp_path_factory):
    from ddserve.config import ModelConfig
    from ddserve.drafter.tiny import write_tiny_drafter

    out = tmp_path_factory.mktemp("drafter")
    return write_tiny_drafter(out, ModelConfig.from_hf(model_dir / "config.json"), block_size=5)


@pytest.fixture(scope="module")
def ray_router(model_dir, drafter_dir):
    import ray

    from ddserve.actors.remote import RayEngineClient, start_router

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    engine = EngineConfig(
        num_slots=SLOTS,
        budget=BUDGET,
        prefill_chunk=16,
        dtype="float32",
        max_streams=3,
        graph_buckets=(1, 2, 4),
    )
    spec = ShardSpec(
        model_path=str(model_dir), world_size=2, drafter_path=str(drafter_dir), engine=engine
    )
    # budgets chosen online (the e2e server covers fixed per-bucket budgets)
    # max_queue 3: three simultaneous requests always fit whatever the arrival timing
    cfg = RouterConfig(shard=spec, max_queue=3, control="fanout",
                       budget_candidates=(1, 3, BUDGET))  # fmt: skip
    group = asyncio.run(start_router(cfg))
    yield RayEngineClient(group.router), group.info
    asyncio.run(group.release())
    ray.shutdown()


@pytest.fixture(scope="module")
def greedy(model_dir):
    import torch

    from ddserve.engine.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(
        model_dir, engine_cfg=EngineConfig(num_slots=4096, dtype="float32"), device="cpu"
    )
    counter = iter(range(10**6))

    def run(ids: list[int], n: int) -> list[int]:
        sid = next(counter)
        runner.add_stream(sid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
        out = runner.prefill()[sid]
        toks = list(out.tokens)
        while out.finished is None:
            out = runner.ar_step([sid])[sid]
            toks += out.tokens
        return toks

    return run


async def _collect(engine, rid: str, ids: list[int], n: int) -> tuple[list[int], str | None]:
    toks, reason = [], None
    async for delta in engine.generate(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True)):
        toks += delta.token_ids
        reason = delta.finish_reason
    return toks, reason


def _prompt(i: int) -> list[int]:
    return [256, *f"prompt number {i}".encode()]


def test_ddtree_streams_over_two_shards_equal_greedy_autoregressive(ray_router, greedy) -> None:
    engine, info = ray_router
    assert info["speculative"]

    async def main():
        return await asyncio.gather(*[_collect(engine, f"a{i}", _prompt(i), 30) for i in range(2)])

    for i, (toks, reason) in enumerate(asyncio.run(main())):
        assert toks == greedy(_prompt(i), 30) and reason == "length"
    stats = asyncio.run(engine.stats())
    assert stats["steps_total"] > 0 and stats["accepted_tokens_per_step"] >= 1.0
    assert stats["kv_slots_used"] == 0 and stats["healthy"]
    # the online tuner tried budgets for the buckets it saw (0: plain steps, which it may pick
    # with this random drafter); output stayed exact regardless
    assert stats["bucket_budgets"] and set(stats["bucket_budgets"].values()) <= {0, 1, 3, BUDGET}


def test_streams_beyond_the_kv_pool_wait_for_slots(ray_router, greedy) -> None:
    engine, _ = ray_router  # 3 streams would need 3 x (17 + 40 + 7) > SLOTS slots
    before = asyncio.run(engine.stats())["deferred_total"]

    async def main():
        return await asyncio.gather(*[_collect(engine, f"b{i}", _prompt(i), 40) for i in range(3)])

    for i, (toks, _) in enumerate(asyncio.run(main())):
        assert toks == greedy(_prompt(i), 40)
    assert asyncio.run(engine.stats())["deferred_total"] > before


def test_a_request_larger_than_the_pool_is_rejected(ray_router) -> None:
    engine, _ = ray_router
    with pytest.raises(RequestRejected, match="KV"):
        asyncio.run(_collect(engine, "huge", [1] * 150, 100))


def test_full_queue_raises_queue_full_and_cancel_frees_everything(ray_router) -> None:
    engine, _ = ray_router

    async def main():
        gens = [
            engine.generate(f"q{i}", _prompt(i), SamplingParams(max_tokens=40)) for i in range(10)
        ]
        results = await asyncio.gather(*[anext(g) for g in gens], return_exceptions=True)
        for g in gens:
            await g.aclose()  # cancels the accepted ones (queued or decoding)
        return results

    results = asyncio.run(main())
    # max_streams + max_queue = 6 are held, counting the streams admitted and the requests
    # waiting (none can finish 40 tokens before the 10 acks): 6 accepted, 4 refused
    assert sum(not isinstance(r, Exception) for r in results) == 6
    assert sum(isinstance(r, QueueFull) for r in results) == 4

    async def settle():
        for _ in range(100):
            s = await engine.stats()
            if s["kv_slots_used"] == s["active_streams"] == s["queue_depth"] == 0:
                return s
            await asyncio.sleep(0.1)
        return s

    s = asyncio.run(settle())
    assert s["kv_slots_used"] == 0 and s["active_streams"] == 0 and s["queue_depth"] == 0
