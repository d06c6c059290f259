"""Issue a fixed list of requests under a load shape, within a hard time bound.

Closed loop (`request_rate is None`): `concurrency` workers, each sending its next request as
soon as its previous one ends. Open loop: requests arrive as a Poisson process of `request_rate`
per second (exponential gaps from a seeded RNG), with at most `concurrency` in flight.
At `duration_s` every request still running is cancelled: it counts in `cancelled`, not in the
results. The run therefore always ends by itself, after at most len(prompts) requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loadtest.datasets import Prompt
from loadtest.metrics import RequestResult

Send = Callable[[Prompt], Awaitable[RequestResult]]


@dataclass(frozen=True)
class LoadShape:
    concurrency: int  # closed loop: workers; open loop: cap on requests in flight
    duration_s: float  # hard bound on the whole run
    request_rate: float | None = None  # requests/s (Poisson); None = closed loop
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s <= 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")


@dataclass
class LoadOutcome:
    results: list[RequestResult] = field(default_factory=list)
    t0: float = 0.0  # perf_counter at the start of the run
    duration_s: float = 0.0  # first request sent -> last request finished (or the bound)
    started: int = 0
    timed_out: bool = False

    @property
    def cancelled(self) -> int:
        return self.started - len(self.results)


def poisson_gaps(rate: float, n: int, seed: int) -> list[float]:
    """n exponential inter-arrival gaps (seconds) of a Poisson process with `rate` per second."""
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def _closed_loop(
    send: Send,
    prompts: list[Prompt],
    shape: LoadShape,
    out: LoadOutcome,
    on_done: Callable[[RequestResult], None],
) -> None:
    queue = iter(prompts)

    async def worker() -> None:
        for prompt in queue:  # a shared iterator: each prompt is taken by exactly one worker
            out.started += 1
            result = await send(prompt)
            out.results.append(result)
            on_done(result)

    await asyncio.gather(*(worker() for _ in range(min(shape.concurrency, len(prompts)))))


async def _open_loop(
    send: Send,
    prompts: list[Prompt],
    shape: LoadShape,
    out: LoadOutcome,
    on_done: Callable[[RequestResult], None],
) -> None:
    assert shape.request_rate is not None
    limit = asyncio.Semaphore(shape.concurrency)
    tasks: list[asyncio.Task] = []

    async def one(prompt: Prompt) -> None:
        async with limit:
            out.started += 1
            result = await send(prompt)
        out.results.append(result)
        on_done(result)

    try:
        for prompt, gap in zip(
            prompts, poisson_gaps(shape.request_rate, len(prompts), shape.seed), strict=True
        ):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_load(
    send: Send,
    prompts: list[Prompt],
    shape: LoadShape,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> LoadOutcome:
    """Send every prompt once under `shape`; see the module docstring."""
    out = LoadOutcome(t0=time.perf_counter())
    loop = _closed_loop if shape.request_rate is None else _open_loop
    task = asyncio.ensure_future(loop(send, prompts, shape, out, on_done))
    done, _ = await asyncio.wait({task}, timeout=shape.duration_s)
    if done:
        task.result()  # re-raise a bug in the client, if any
    else:
        out.timed_out = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    last_end = max((r.end for r in out.results), default=out.t0)
    out.duration_s = (out.t0 + shape.duration_s if out.timed_out else last_end) - out.t0
    return out
