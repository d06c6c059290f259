"""Online choice of each bucket's DDTree budget: maximize committed tokens per second.

A bigger tree commits more tokens per step but makes the step dearer (more distinct experts to
stream, more attention rows); where the balance lies depends on the drafter's acceptance on the
live traffic and on the step cost at that batch size, so it is measured, not assumed
(DESIGN.md section 8). Any budget is lossless, so switching changes speed only, never outputs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Estimate:
    tokens: float = 0.0  # EWMA of tokens one stream commits per step
    seconds: float = 0.0  # EWMA of step seconds
    n: int = 0

    def update(self, tokens: float, seconds: float, decay: float) -> None:
        w = 1.0 if self.n == 0 else 1.0 - decay
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.n += 1

    @property
    def rate(self) -> float:
        """Committed tokens per stream per second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BudgetTuner:
    """Per bucket: try every candidate `warmup` times, then use the best measured rate, and
    every `explore_every`-th step of the bucket re-measure the next candidate in turn so the
    estimates follow the traffic. Deterministic (no random numbers)."""

    def __init__(
        self,
        candidates: tuple[int, ...],
        warmup: int = 3,
        explore_every: int = 20,
        decay: float = 0.9,
    ) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"budget candidates must be positive, got {candidates}")
        if warmup < 1 or explore_every < 2 or not 0.0 <= decay < 1.0:
            raise ValueError("need warmup >= 1, explore_every >= 2 and 0 <= decay < 1")
        self.candidates = tuple(sorted(set(candidates)))
        self.warmup, self.explore_every, self.decay = warmup, explore_every, decay
        self._est: dict[tuple[int, int], _Estimate] = {}
        self._steps: dict[int, int] = {}

    def choose(self, bucket: int) -> int:
        step = self._steps.get(bucket, 0)
        self._steps[bucket] = step + 1
        fresh = [c for c in self.candidates if self._n(bucket, c) < self.warmup]
        if fresh:
            return fresh[0]
        if step % self.explore_every == 0:
            k = step // self.explore_every
            return self.candidates[k % len(self.candidates)]
        return self.best(bucket)

    def best(self, bucket: int) -> int:
        """The candidate with the highest measured rate (ties: the smaller tree)."""
        return max(self.candidates, key=lambda c: (self._rate(bucket, c), -c))

    def record(self, bucket: int, budget: int, tokens_per_stream: float, seconds: float) -> None:
        est = self._est.setdefault((bucket, budget), _Estimate())
        est.update(tokens_per_stream, seconds, self.decay)

    def snapshot(self) -> dict[int, int]:
        """bucket -> the budget it currently prefers (buckets seen so far)."""
        return {b: self.best(b) for b in sorted(self._steps)}

    def _n(self, bucket: int, budget: int) -> int:
        est = self._est.get((bucket, budget))
        return est.n if est else 0

    def _rate(self, bucket: int, budget: int) -> float:
        est = self._est.get((bucket, budget))
        return est.rate if est else 0.0


def default_candidates(engine_budget: int) -> tuple[int, ...]:
    """Powers of two from 4 up to the engine's budget, and the engine's budget itself."""
    return tuple(
        sorted({b for b in (4, 8, 16, 32, 64, 128) if b <= engine_budget} | {engine_budget})
    )
