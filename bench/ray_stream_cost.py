"""What delivering a step's tokens costs over Ray: one streaming call per request (how the Router
serves today) against one streaming call for all of them.

    python bench/ray_stream_cost.py --streams 1,5,10 --step-ms 1,3,10 --out stream_cost.json

A stand-in for the Router (no model): an async actor whose own thread "steps" every --step-ms
milliseconds (sleeping, as the Router's thread waits on its shards with the GIL released) and
hands each of S streams one item per step, as `Router._apply` does (`loop.call_soon_threadsafe`
into an asyncio queue per request). The caller, like a Serve replica, consumes either S
concurrent `num_returns="streaming"` calls, one per request ("per-request", the Router's
`generate`), or one streaming call whose items carry every stream's tokens of a step
("batched"); each call coalesces what its queue holds into one yield, as `Router.generate`
does. Reported per configuration: the steps the actor's thread completed per second of wall
time against the target rate (a thread starved of the GIL by the event loop falls behind), the
delay from the hand-off of the oldest step a yield carries to the caller's receipt (median,
p90), the steps a yield carries on average (above 1: the yields fall behind the steps), and the
actor process's CPU time per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path

import ray


@ray.remote
class Stepper:
    """Steps on a thread; each step puts (step, t_put) for every stream into per-stream queues
    (per-request mode) or one (step, t_put, S) item into a shared queue (batched mode)."""

    def __init__(self) -> None:
        self.loop = None

    async def run(self, streams: int, steps: int, step_ms: float, batched: bool):
        self.loop = asyncio.get_running_loop()
        self.queues = [asyncio.Queue() for _ in range(1 if batched else streams)]
        self.done = asyncio.Event()
        self.cpu0, self.t0 = time.process_time(), time.perf_counter()
        threading.Thread(
            target=self._steps, args=(streams, steps, step_ms / 1e3, batched), daemon=True
        ).start()

    def _steps(self, streams: int, steps: int, step_s: float, batched: bool) -> None:
        nxt = time.perf_counter()
        for k in range(steps):
            nxt += step_s
            time.sleep(max(0.0, nxt - time.perf_counter()))  # the shard call: GIL released
            now = time.perf_counter()
            if batched:
                item = (k, now, [list(range(4))] * streams)
                self.loop.call_soon_threadsafe(self.queues[0].put_nowait, item)
            else:
                for q in self.queues:
                    self.loop.call_soon_threadsafe(q.put_nowait, (k, now, list(range(4))))
        self.t_end = time.perf_counter()
        self.cpu_end = time.process_time()
        self.loop.call_soon_threadsafe(self.done.set)

    async def stream(self, i: int, steps: int):
        """Yields what its queue holds, coalesced as `Router.generate` does: the oldest item's
        hand-off time and how many steps the yield carries."""
        q, got = self.queues[i], 0
        while got < steps:
            k, t_put, _ = await q.get()
            n = 1
            while not q.empty():
                q.get_nowait()
                n += 1
            got += n
            yield (k, t_put, n)

    async def result(self) -> dict:
        await self.done.wait()
        return {"wall_s": self.t_end - self.t0, "cpu_s": self.cpu_end - self.cpu0}


async def consume(gen, lags: list[float], sizes: list[int]) -> None:
    async for ref in gen:
        _, t_put, n = await ref
        lags.append(time.perf_counter() - t_put)  # one host: perf_counter is comparable
        sizes.append(n)


async def one(streams: int, steps: int, step_ms: float, batched: bool) -> dict:
    actor = Stepper.options(max_concurrency=1000).remote()
    await actor.run.remote(streams, steps, step_ms, batched)
    n = 1 if batched else streams
    gens = [actor.stream.options(num_returns="streaming").remote(i, steps) for i in range(n)]
    lags: list[float] = []
    sizes: list[int] = []
    await asyncio.gather(*[consume(g, lags, sizes) for g in gens])
    res = await actor.result.remote()
    ray.kill(actor)
    return {
        "streams": streams,
        "mode": "batched" if batched else "per-request",
        "step_ms_target": step_ms,
        "steps_per_s": round(steps / res["wall_s"], 1),
        "target_steps_per_s": round(1e3 / step_ms, 1),
        "delivery_lag_ms_median": round(1e3 * statistics.median(lags), 3),
        "delivery_lag_ms_p90": round(1e3 * sorted(lags)[int(0.9 * len(lags))], 3),
        "actor_cpu_ms_per_step": round(1e3 * res["cpu_s"] / steps, 3),
        "steps_per_yield": round(statistics.mean(sizes), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,5,10", help="comma list of stream counts")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-ms", default="1,3,10", help="comma list: the stand-in step's time")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    rows = []
    try:
        for ms in [float(x) for x in args.step_ms.split(",")]:
            for s in [int(x) for x in args.streams.split(",")]:
                for batched in (False, True):
                    row = asyncio.run(one(s, args.steps, ms, batched))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        ray.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
