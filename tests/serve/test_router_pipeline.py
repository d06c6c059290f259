"""The Router's step loop with Commands in flight (`RouterConfig.pipeline`), without Ray: its
shard group is one real CPU runner (a tiny random model and drafter) applying each Command in a
worker thread, as a shard does, while the loop plans and sends the next.

Checked: with 2 in flight the loop does send a Command before the previous result is in, and
streams of different lengths (so that some finish in a result the next plan did not see), one
arriving mid-run and one aborted mid-run, give exactly what plain greedy decoding gives alone.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from ddserve.actors.client import TokenDelta
from ddserve.actors.router import Router, RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.actors.shard_group import ShardGroup
from ddserve.engine.command import Command, CommandResult, apply_command
from ddserve.engine.config import EngineConfig
from ddserve.engine.runner import ModelRunner
from ddserve.sampling import SamplingParams
from tests.engine_helpers import greedy_reference

ENGINE = EngineConfig(num_slots=400, budget=4, prefill_chunk=16, dtype="float32", max_streams=3)
LENGTHS = [3, 11, 6, 8]  # max_tokens of the four requests; request 3 arrives mid-run


@pytest.fixture(scope="module")
def drafter_dir(tiny_int4_model_dir, tmp_path_factory):
    from ddserve.config import ModelConfig
    from ddserve.drafter.tiny import write_tiny_drafter

    cfg = ModelConfig.from_hf(tiny_int4_model_dir / "config.json")
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), cfg, block_size=5)


class ThreadedShard(ShardGroup):
    """One runner applying Commands in order on its own thread; counts the Commands sent and
    not yet collected (`most_in_flight`: the largest count seen when one was sent)."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__([], timeout_s=60.0)
        self.runner, self._pool = runner, ThreadPoolExecutor(1)
        self._lock = threading.Lock()
        self.sent = self.collected = self.most_in_flight = 0

    def submit(self, cmd: Command) -> Future:
        with self._lock:
            self.sent += 1
            self.most_in_flight = max(self.most_in_flight, self.sent - self.collected)
        return self._pool.submit(apply_command, self.runner, cmd)

    def result(self, handle: Future) -> CommandResult:
        res = handle.result(timeout=self.timeout_s)
        with self._lock:
            self.collected += 1
        return res

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _prompt(i: int) -> list[int]:
    return [256, *f"request {i} says".encode()]


async def _serve(router: Router, shard: ThreadedShard) -> tuple[dict, dict]:
    """Four requests through the router (one aborted after its third token, one submitted
    once another has its first tokens): (tokens, finish reasons) by request index."""
    router._group = shard
    router._begin_steps()
    toks: dict[int, list[int]] = {i: [] for i in range(len(LENGTHS))}
    reasons: dict[int, str | None] = {}
    stream = router.subscribe("replica")

    async def submit(i: int) -> None:
        params = SamplingParams(max_tokens=LENGTHS[i], ignore_eos=True)
        await router.submit(f"r{i}", _prompt(i), params, "replica")

    for i in range(3):
        await submit(i)
    late = aborted = False
    while len(reasons) < len(LENGTHS):
        items = await asyncio.wait_for(anext(stream), timeout=60)
        for rid, item in items:
            assert isinstance(item, TokenDelta), item
            i = int(rid[1:])
            if i == 2 and aborted:  # posted before the abort reached the router
                continue
            assert i not in reasons  # nothing after a request's last item
            toks[i] += item.token_ids
            if item.finish_reason is not None:
                reasons[i] = item.finish_reason
        if not late and toks[1]:
            late = True
            await submit(3)
        if not aborted and len(toks[2]) >= 3:
            aborted = True
            await router.abort("r2")
            reasons[2] = "aborted"
    router._stopping = True
    router._s.wake.set()
    await asyncio.to_thread(router._thread.join, 60)
    await stream.aclose()
    return toks, reasons


@pytest.mark.parametrize("pipeline", [1, 2])
def test_commands_in_flight_keep_every_stream_exact(
    tiny_int4_model_dir, drafter_dir, pipeline
) -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(tiny_int4_model_dir, engine_cfg=ENGINE, drafter=drafter_dir, device="cpu")
    spec = ShardSpec(model_path=str(tiny_int4_model_dir), engine=ENGINE)
    router = Router(RouterConfig(shard=spec, pipeline=pipeline, warmup=False), pg=None)
    router._s.sched.speculative = True
    shard = ThreadedShard(runner)
    toks, reasons = asyncio.run(_serve(router, shard))
    shard.close()
    assert shard.most_in_flight == pipeline  # 2: the next step was sent while one ran
    for i, n in enumerate(LENGTHS):
        want = greedy_reference(tiny_int4_model_dir, [_prompt(i)], n, ignore_eos=True)[0]
        if i == 2:
            assert reasons[i] == "aborted" and toks[i] == want[: len(toks[i])]
        else:
            assert reasons[i] == "length" and toks[i] == want, i
    # every stream left the runner (the aborted one by its cancel) and freed its KV slots
    for _ in range(200):
        if not runner.streams:
            break
        threading.Event().wait(0.01)
    assert not runner.streams and runner.free_slots == ENGINE.num_slots
    stats = asyncio.run(router.stats())
    assert stats["steps_total"] > 0 and stats["healthy"]
