"""Warm-up: run every step shape the Router will use before the replica reports ready.

The first step of each shape compiles its kernels and, with CUDA graphs, captures its graph
(seconds on a fresh GPU machine; the first requests' TTFT p90 was 3.5 s against 0.17 s warm).
So before serving, for every batch size bucket a batch can reach and every tree budget it may
run (per-bucket budgets, or each online candidate), the Router admits that many short dummy
streams, prefills them, runs one decode step and cancels them, through the same shard group
and Commands as real traffic. Prefix lengths stay under the smallest graph prefix capacity
(engine/graphs.py), so larger capacities are still captured on first use. On CPU this is one
short step per bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass

from ddserve.actors.shard import Command
from ddserve.actors.shard_group import ShardGroup
from ddserve.sampling import SamplingParams

log = logging.getLogger(__name__)

PROMPT_LEN = 8  # tokens per dummy prompt (stream i gets PROMPT_LEN + i: varied chunk shapes)
MAX_PREFILL_COMMANDS = 10_000


@dataclass(frozen=True)
class WarmupRound:
    streams: int  # batch size; pads to `bucket`
    bucket: int
    budget: int | None  # tree budget; None: a plain autoregressive step


def warmup_rounds(
    buckets: tuple[int, ...],
    max_streams: int,
    budgets_per_bucket: list[tuple[int, ...]] | None,
) -> list[WarmupRound]:
    """One round per reachable bucket and budget. `budgets_per_bucket[i]`: the budgets bucket i
    may run; None: autoregressive steps. A bucket is reachable when up to max_streams streams
    pad to it (more than the previous bucket)."""
    rounds, prev = [], 0
    for i, b in enumerate(buckets):
        n = min(b, max_streams)
        if n <= prev:
            break
        options = budgets_per_bucket[i] if budgets_per_bucket is not None else (None,)
        rounds += [WarmupRound(n, b, budget) for budget in options]
        prev = b
    return rounds


def run_warmup(group: ShardGroup, rounds: list[WarmupRound], vocab_size: int) -> float:
    """Runs every round through `group` (a progress bar in the driver's terminal); returns the
    seconds it took. Leaves no stream and no KV slot behind."""
    from ray.experimental.tqdm_ray import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=len(rounds), desc="ddserve warm-up (kernels, CUDA graphs)", unit="shape")
    for k, rnd in enumerate(rounds):
        _run_round(group, rnd, vocab_size, k)
        bar.update(1)
    bar.close()
    took = time.perf_counter() - t0
    log.info("warm-up: %d step shapes in %.1f s", len(rounds), took)
    return took


def _run_round(group: ShardGroup, rnd: WarmupRound, vocab_size: int, k: int) -> None:
    """Admit, prefill, one step, cancel."""
    params = SamplingParams(max_tokens=(rnd.budget or 0) + 2, ignore_eos=True)
    sids = [("warmup", k, i) for i in range(rnd.streams)]
    add = tuple((sid, _prompt(i, vocab_size), params) for i, sid in enumerate(sids))
    res = group.run(Command(add=add, prefill=True))
    admitted, ready = list(res.admitted), set(res.outputs)
    for _ in range(MAX_PREFILL_COMMANDS):
        if ready >= set(admitted):
            break
        ready |= set(group.run(Command(prefill=True)).outputs)
    if len(admitted) < rnd.streams:
        log.warning("warm-up: %d of %d streams fit in the KV cache", len(admitted), rnd.streams)
    step: tuple[Hashable, ...] = tuple(admitted)
    if step:
        group.run(
            Command(step=step, speculative=rnd.budget is not None, bucket=rnd.bucket,
                    budget=rnd.budget or 0)
        )  # fmt: skip
    group.run(Command(cancel=step))


def _prompt(i: int, vocab_size: int) -> list[int]:
    return [(7 * i + j) % vocab_size for j in range(PROMPT_LEN + i)]
