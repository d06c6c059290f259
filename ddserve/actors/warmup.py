"""Warm-up: run every step shape the Router will use before the replica reports ready.

The first step of each shape compiles its kernels and, with CUDA graphs, captures its graph
(seconds on a fresh GPU machine; the first requests' TTFT p90 was 3.5 s against 0.17 s warm).
A graph is keyed by (bucket, tree budget, prefix capacity): the batch padded to a bucket, the
nodes per stream, and the longest prefix rounded up to a power of two >= 256
(engine/graphs.py). So before serving, for every prefix capacity up to `max_prefix`, the warm-up
keeps one "anchor" stream whose prefix lies in that capacity, and for every batch size up to
max_streams and every budget its bucket may run, adds short dummy streams to make up the batch,
prefills them, runs one decode step and cancels them, through the same Commands as real
traffic. The
anchor is replaced when its prefix would outgrow the capacity. Without CUDA graphs (CPU) only
the smallest capacity runs: one short step per bucket. Nothing is left behind: every stream is
cancelled, so the KV pool ends as it started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any, Protocol

from ddserve.actors.shard import Command, CommandResult
from ddserve.sampling import SamplingParams

if TYPE_CHECKING:
    from ddserve.actors.router import RouterConfig

log = logging.getLogger(__name__)

PROMPT_LEN = 8  # tokens per short dummy prompt (stream i gets PROMPT_LEN + i)
MIN_CAPACITY = 256  # the smallest graph prefix capacity (engine/graphs.py)
MAX_PREFILL_COMMANDS = 10_000


class StepRunner(Protocol):
    """What runs a Command on every rank (`ShardGroup`; or one ShardWorker, without Ray)."""

    def run(self, cmd: Command) -> CommandResult: ...


@dataclass(frozen=True)
class Shape:
    streams: int  # batch size; pads to `bucket`
    bucket: int
    budget: int | None  # tree budget; None: a plain autoregressive step


@dataclass(frozen=True)
class WarmupPlan:
    shapes: tuple[Shape, ...]
    capacities: tuple[int, ...]  # graph prefix capacities, each run with every shape

    @property
    def total(self) -> int:
        return len(self.shapes) * len(self.capacities)


def step_shapes(
    buckets: tuple[int, ...], max_streams: int, budgets_per_bucket: list[tuple[int, ...]] | None
) -> tuple[Shape, ...]:
    """One shape per batch size 1..max_streams (padded to the smallest bucket that holds it) and
    budget. `budgets_per_bucket[i]`: the budgets bucket i may run; None: autoregressive steps.
    Every batch size, not only one per bucket: the eager parts of a step (draft, tree build)
    still pay ~50 ms the first time they see a batch size on a GPU."""
    shapes: list[Shape] = []
    for n in range(1, max_streams + 1):
        i = next(i for i, b in enumerate(buckets) if b >= n)
        options = budgets_per_bucket[i] if budgets_per_bucket is not None else (None,)
        shapes += [Shape(n, buckets[i], budget) for budget in options]
    return tuple(shapes)


def prefix_capacities(graphs: bool, max_prefix: int) -> tuple[int, ...]:
    """256, 512, ... up to `max_prefix` with CUDA graphs; just 256 without (no graph keys)."""
    caps = [MIN_CAPACITY]
    while graphs and caps[-1] * 2 <= max_prefix:
        caps.append(caps[-1] * 2)
    return tuple(caps)


def warmup_plan(cfg: RouterConfig, info: dict) -> WarmupPlan:
    """Every batch size with each budget its bucket may run (per-bucket budgets, or each online
    candidate; AR steps without a drafter), at every graph prefix capacity a stream can reach,
    bounded by `cfg.warmup_max_prefix`, the context and a quarter of the KV pool."""
    spec, engine = cfg.shard, cfg.shard.engine
    per_bucket = None
    if info["speculative"]:
        per_bucket = [cfg.budget_candidates or (cfg.bucket(b)[1],) for b in cfg.buckets]
    shapes = step_shapes(cfg.buckets, cfg.max_streams, per_bucket)
    limit = min(cfg.warmup_max_prefix, info["max_position_embeddings"], engine.num_slots // 4)
    graphs = engine.cuda_graphs and spec.device.startswith("cuda")
    return WarmupPlan(shapes, prefix_capacities(graphs, limit))


def run_warmup(group: StepRunner, plan: WarmupPlan, vocab_size: int) -> float:
    """Runs every shape at every capacity through `group` with a progress bar; returns the
    seconds it took. Leaves no stream and no KV slot behind."""
    t0 = time.perf_counter()
    bar = _progress_bar(plan.total, "ddserve warm-up (kernels, CUDA graphs)")
    ids = (("warmup", k) for k in count())
    for cap in plan.capacities:
        anchor = _Anchor(cap, vocab_size, ids)
        for shape in plan.shapes:
            _run_shape(group, shape, anchor, vocab_size, ids)
            bar.update(1)
        anchor.drop(group)
    bar.close()
    took = time.perf_counter() - t0
    log.info("warm-up: %d step shapes in %.1f s", plan.total, took)
    return took


class _Anchor:
    """One stream whose prefix lies in (cap / 2, cap], so a batch holding it uses the graphs of
    capacity `cap` (a short prompt for the smallest capacity)."""

    def __init__(self, cap: int, vocab_size: int, ids: Iterator[Hashable]) -> None:
        self.cap, self.ids = cap, ids
        n = PROMPT_LEN if cap == MIN_CAPACITY else cap // 2 + 1
        self.prompt = [(5 * j + 1) % vocab_size for j in range(n)]
        self.sid: Hashable | None = None
        self.length = 0  # prompt + emitted tokens: at least the prefix the next step sees

    def request(self, budget: int | None) -> tuple[Hashable, list[int], SamplingParams] | None:
        """A new anchor stream to add when the current one has no room for one more step."""
        if self.sid is not None and self.length + (budget or 0) + 1 <= self.cap:
            return None
        self.sid, self.length = next(self.ids), len(self.prompt)
        room = max(self.cap - len(self.prompt), 2)
        return self.sid, self.prompt, SamplingParams(max_tokens=room, ignore_eos=True)

    def record(self, res: CommandResult) -> None:
        out = res.outputs.get(self.sid)
        if out is not None:
            self.length += len(out.tokens)
            if out.finished is not None:
                self.sid = None  # the engine has dropped it

    def drop(self, group: StepRunner) -> None:
        if self.sid is not None:
            group.run(Command(cancel=(self.sid,)))
            self.sid = None


def _run_shape(
    group: StepRunner, shape: Shape, anchor: _Anchor, vocab: int, ids: Iterator[Hashable]
) -> None:
    """Make up a batch of `shape.streams` (the anchor and short streams), prefill, one step,
    cancel the short streams."""
    old = anchor.sid
    fresh = anchor.request(shape.budget)
    params = SamplingParams(max_tokens=(shape.budget or 0) + 2, ignore_eos=True)
    short = [(next(ids), _prompt(i, vocab), params) for i in range(shape.streams - 1)]
    cancel = (old,) if fresh is not None and old is not None else ()
    add = ([fresh] if fresh is not None else []) + short
    res = group.run(Command(cancel=cancel, add=tuple(add), prefill=True))
    admitted = _prefill(group, res)
    anchor.record(res)
    if fresh is not None and anchor.sid not in admitted:
        log.warning("warm-up: no KV room for a %d-token prefix", len(anchor.prompt))
        anchor.sid = None
    kept = (anchor.sid,) if fresh is None and anchor.sid is not None else ()
    batch = kept + tuple(admitted)
    if len(batch) < shape.streams:
        log.warning("warm-up: %d of %d streams fit in the KV cache", len(batch), shape.streams)
    if batch:
        res = group.run(Command(step=batch, speculative=shape.budget is not None,
                                bucket=shape.bucket, budget=shape.budget or 0))  # fmt: skip
        anchor.record(res)
    group.run(Command(cancel=tuple(s for s in batch if s != anchor.sid)))


def _prefill(group: StepRunner, res: CommandResult) -> list[Hashable]:
    """Prefill until every admitted stream of `res` has its first token; returns them."""
    admitted, ready = list(res.admitted), set(res.outputs)
    for _ in range(MAX_PREFILL_COMMANDS):
        if ready >= set(admitted):
            break
        ready |= set(group.run(Command(prefill=True)).outputs)
    return admitted


def _prompt(i: int, vocab_size: int) -> list[int]:
    return [(7 * i + j) % vocab_size for j in range(PROMPT_LEN + i)]


def _progress_bar(total: int, desc: str) -> Any:
    """Inside a Ray actor, a bar drawn by the driver (`ray.experimental.tqdm_ray`); else tqdm."""
    try:
        import ray

        if ray.is_initialized():
            from ray.experimental.tqdm_ray import tqdm as ray_tqdm

            return ray_tqdm(total=total, desc=desc, unit="shape")
    except ImportError:
        pass
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="shape")
