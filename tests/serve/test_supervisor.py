"""SupervisedEngine's rebuild policy over fake groups (no Ray): a failed group is released and
replaced while requests fail fast with a Retry-After; the replica stays healthy while a rebuild
can still succeed, and reports unhealthy after a bounded number of attempts with back-off."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from serve_fakes import FakeEngine

from ddserve.actors.client import EngineDead
from ddserve.actors.supervisor import RebuildPolicy, SupervisedEngine
from ddserve.sampling import SamplingParams

FAST = RebuildPolicy(attempts=3, backoff_s=0.05, backoff_max_s=1.0, min_start_timeout_s=5.0)


class FakeGroup:
    def __init__(self, generation: int, engine: FakeEngine | None = None) -> None:
        self.info = {"generation": generation}
        self.client = engine or FakeEngine(chunk=2)
        self.failed = asyncio.Event()
        self.released = False

    async def wait_failed(self) -> str:
        await self.failed.wait()
        return "a tensor-parallel shard failed"

    async def release(self) -> None:
        self.released = True


class Starts:
    """start(generation): the groups started, in order; `gate` holds the starts after the
    first until set; generations in `broken` raise."""

    def __init__(self, broken: set[int] | None = None, engine: FakeEngine | None = None) -> None:
        self.groups: list[FakeGroup] = []
        self.times: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.broken = broken or set()
        self.engine = engine

    async def __call__(self, generation: int) -> FakeGroup:
        self.times.append(time.monotonic())
        if generation > 1:
            await self.gate.wait()
        if generation in self.broken:
            raise RuntimeError(f"no weights for generation {generation}")
        group = FakeGroup(generation, self.engine if generation == 1 else None)
        self.groups.append(group)
        return group


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _text(engine: SupervisedEngine, rid: str = "r") -> list[int]:
    toks = []
    async for d in engine.generate(rid, [1, 2, 3], SamplingParams(max_tokens=4)):
        toks += d.token_ids
    return toks


def test_a_failed_group_is_released_and_replaced_while_requests_fail_fast() -> None:
    async def main() -> None:
        starts = Starts()
        engine = SupervisedEngine(starts, FAST)
        assert (await engine.start())["generation"] == 1
        assert await _text(engine) == [1, 2, 3, 1]
        starts.gate.clear()  # the rebuild waits here
        starts.groups[0].failed.set()
        await _until(lambda: engine.state == "rebuilding" and starts.groups[0].released)
        # The rebuild waits on the gate: a request that waited for it would time out here,
        # however long a loaded machine takes to answer one that fails fast.
        with pytest.raises(EngineDead, match="shard failed; the engine is restarting") as e:
            await asyncio.wait_for(_text(engine), timeout=10.0)
        assert e.value.retry_after >= 1.0
        await engine.check_health()  # rebuilding is healthy: Serve must not replace it
        stats = await engine.stats()
        assert not stats["healthy"] and stats["engine_state"] == "rebuilding"
        starts.gate.set()
        await _until(lambda: engine.state == "serving")
        assert await _text(engine) == [1, 2, 3, 1]
        assert (await engine.stats())["rebuilds_total"] == 1 and len(starts.groups) == 2
        await engine.close()
        assert starts.groups[1].released

    asyncio.run(main())


def test_a_stream_cut_by_the_failure_ends_with_engine_dead_and_a_retry_after() -> None:
    async def main() -> None:
        dying = FakeEngine(chunk=1)
        dying.die_after_tokens = 2
        engine = SupervisedEngine(Starts(engine=dying), FAST)
        await engine.start()
        with pytest.raises(EngineDead, match="shard 1 died") as e:
            await _text(engine)
        assert e.value.retry_after is not None and e.value.retry_after >= 1.0
        await engine.close()

    asyncio.run(main())


def test_retry_after_counts_the_back_off_before_the_next_attempt() -> None:
    async def main() -> tuple[float, float, dict]:
        starts = Starts(broken={2})  # attempt 1 fails; attempt 2 waits 5 s first
        engine = SupervisedEngine(starts, RebuildPolicy(attempts=2, backoff_s=5.0))
        await engine.start()
        starts.groups[0].failed.set()
        await _until(lambda: len(starts.times) == 2)  # attempt 1 ran (and failed at once)
        await asyncio.sleep(0.2)  # into attempt 2's back-off
        with pytest.raises(EngineDead) as e:
            await _text(engine)
        stats = await engine.stats()
        await engine.close()
        return e.value.retry_after, time.monotonic() - starts.times[1], stats

    retry_after, since_failure, stats = asyncio.run(main())
    # 5 s of back-off, then a start as long as the first (instant here), less the time since
    # the attempt began: 5 s less what this took (a loaded machine may take seconds)
    assert 5.0 - since_failure - 0.1 <= retry_after <= 5.0, (retry_after, since_failure)
    assert retry_after > 2.0  # not the 1 s floor
    assert stats["engine_state"] == "rebuilding" and stats["retry_after_s"] <= retry_after


def test_rebuilds_that_keep_failing_back_off_then_report_unhealthy(caplog) -> None:
    async def main() -> Starts:
        starts = Starts(broken={2, 3, 4})
        engine = SupervisedEngine(starts, FAST)
        await engine.start()
        starts.groups[0].failed.set()
        await _until(lambda: engine.state == "failed")
        with pytest.raises(RuntimeError, match="could not be restarted"):
            await engine.check_health()
        with pytest.raises(EngineDead):
            await _text(engine)
        await engine.close()
        return starts

    with caplog.at_level(logging.WARNING, logger="ddserve.actors.supervisor"):
        starts = asyncio.run(main())
    gaps = [b - a for a, b in zip(starts.times[1:], starts.times[2:], strict=False)]
    assert len(starts.times) == 1 + FAST.attempts  # the first start, then 3 attempts, no more
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # 0.05 s, then doubled
    text = caplog.text
    assert all(f"attempt {n} of 3 failed: RuntimeError: no weights" in text for n in (1, 2, 3))
    assert "giving up after 3 rebuild attempts" in text


def test_a_group_that_fails_again_right_after_each_rebuild_ends_unhealthy() -> None:
    async def main() -> tuple[SupervisedEngine, Starts]:
        starts = Starts()
        engine = SupervisedEngine(starts, FAST)  # stable_s 60: every failure continues the count
        await engine.start()
        for n in range(1, FAST.attempts + 2):
            await _until(lambda n=n: len(starts.groups) == n or engine.state == "failed")
            starts.groups[-1].failed.set()
        await _until(lambda: engine.state == "failed")
        await engine.close()
        return engine, starts

    engine, starts = asyncio.run(main())
    assert engine.rebuilds == FAST.attempts and len(starts.groups) == 1 + FAST.attempts


def test_a_rebuild_that_hangs_is_timed_out_and_retried() -> None:
    async def main() -> None:
        starts = Starts()
        policy = RebuildPolicy(attempts=2, backoff_s=0.01, min_start_timeout_s=0.2)
        engine = SupervisedEngine(starts, policy)
        await engine.start()
        starts.gate.clear()  # attempt 1 hangs until the timeout
        starts.groups[0].failed.set()
        await _until(lambda: len(starts.times) == 2)
        await _until(lambda: len(starts.times) == 3, timeout=2.0)  # timed out, retried
        starts.gate.set()
        await _until(lambda: engine.state == "serving")
        await engine.close()

    asyncio.run(main())


def test_no_rebuild_attempts_means_unhealthy_at_the_first_failure() -> None:
    async def main() -> None:
        starts = Starts()
        engine = SupervisedEngine(starts, RebuildPolicy(attempts=0))
        await engine.start()
        starts.groups[0].failed.set()
        await _until(lambda: engine.state == "failed")
        assert len(starts.times) == 1 and starts.groups[0].released
        with pytest.raises(RuntimeError):
            await engine.check_health()
        await engine.close()

    asyncio.run(main())
