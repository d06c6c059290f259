"""Engine-side counters the Router keeps and reports through `stats()` (plain data)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Step-time histogram bounds in seconds: sub-ms GPU steps up to multi-second CPU prefills.
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = STEP_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bound, non-cumulative; last = +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.total += x
        self.n += 1

    def snapshot(self) -> dict:
        """Cumulative buckets as Prometheus wants them: [(le, count)], last le = inf."""
        cum, out = 0, []
        for le, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cum += c
            out.append((le, cum))
        return {"buckets": out, "sum": self.total, "count": self.n}


@dataclass
class EngineStats:
    """Decode-loop counters. A step is one batched verify/decode pass over the active streams."""

    steps: int = 0
    stream_steps: int = 0  # sum over steps of the streams in the batch
    deferred: int = 0  # admissions put back in the queue for lack of KV slots
    committed_tokens: int = 0  # tokens emitted by decode steps (not counting prefill's first token)
    step_seconds: Histogram = field(default_factory=Histogram)
    control_seconds: Histogram = field(default_factory=Histogram)  # router+Ray time outside shards

    def record_step(self, streams: int, committed: int, wall_s: float, shard_s: float) -> None:
        self.steps += 1
        self.stream_steps += streams
        self.committed_tokens += committed
        self.step_seconds.observe(wall_s)
        self.control_seconds.observe(max(wall_s - shard_s, 0.0))

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens one stream commits per step (1.0 for plain AR decoding)."""
        return self.committed_tokens / self.stream_steps if self.stream_steps else 0.0

    def snapshot(self) -> dict:
        return {
            "steps_total": self.steps,
            "stream_steps_total": self.stream_steps,
            "deferred_total": self.deferred,
            "committed_tokens_total": self.committed_tokens,
            "accepted_tokens_per_step": self.accepted_per_step,
            "step_seconds": self.step_seconds.snapshot(),
            "control_seconds": self.control_seconds.snapshot(),
        }
