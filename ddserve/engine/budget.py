"""Online choice of each bucket's DDTree budget: maximize committed tokens per second.

A bigger tree commits more tokens per step but makes the step dearer (more distinct experts to
stream, more attention rows); where the balance lies depends on the drafter's acceptance on the
live traffic and on the step cost at that batch size, so it is measured, not assumed. Any budget
is lossless, so switching changes speed only, never outputs.

Budget 0 is the empty tree: the step verifies the root alone, i.e. plain autoregressive decoding
with no draft (`ModelRunner.ddtree_step(sids, 0)`). It is a candidate unless `plain=False`, so
where no tree pays (a slow CPU, a large batch, traffic the drafter predicts badly) the tuner
settles on plain decoding by measurement: speculation is never slower than plain decoding by
more than what exploring costs, at most 1 / (4 explore_every) of the best rate (see `choose`).

Acceptance is noisy step to step, so one step at a budget says little; but the best-first tree
of b nodes is the first b nodes of any bigger tree (`ddtree/tree.py`), so one step at
budget B also says what every b <= B would have committed (`tokens_at_budgets`): the walk stops
at the first accepted node beyond row b. The tuner keeps acceptance and step time apart. It
estimates a candidate's acceptance as the next smaller one's plus the gain between the two,
measured on the same steps (paired, so the text's easy and hard stretches cancel): the smaller
trees' figures are refreshed by every step, the bigger trees' gains by the steps that ran them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ddserve.engine.stream import StepOutput

PLAIN = 0  # the empty tree: a plain autoregressive step


@dataclass
class _Ewma:
    """The mean of the first 1 / (1 - decay) samples, then an exponentially weighted one (so the
    first few samples, often from an unusual stretch such as a generation's first steps, do not
    outweigh the next ones)."""

    value: float = 0.0
    n: int = 0

    def update(self, x: float, decay: float) -> None:
        self.n += 1
        self.value += max(1.0 / self.n, 1.0 - decay) * (x - self.value)


@dataclass
class _Candidate:
    tokens: _Ewma = field(default_factory=_Ewma)  # tokens one stream commits per step
    gain: _Ewma = field(default_factory=_Ewma)  # tokens beyond the next smaller candidate's
    seconds: _Ewma = field(default_factory=_Ewma)  # step seconds


@dataclass
class _Bucket:
    turn: int = 0  # round-robin position of the next candidate to re-measure
    since_explore: float = 0.0  # step seconds recorded since the last re-measurement
    grow: bool = False  # the last step's tree was full to its depth: try the next larger one


class BudgetTuner:
    """Per bucket: time every candidate `warmup` times (largest first: its steps also measure the
    acceptance of every smaller one), then use the best measured rate R. To follow the traffic,
    the other candidates are re-timed in turn, largest first: candidate c (step time s, rate r)
    once the bucket has spent explore_every * s * R / r seconds since the last re-measurement.
    A candidate close to the best is re-checked soon, a poor one rarely, and the tokens lost to
    exploring stay below r (R - r) / (explore_every R^2) <= 1 / (4 explore_every) of what the
    best alone would commit, however dear or poor a candidate is. One more rule: a step whose
    tree was accepted to its full depth (`record(saturated=True)`) says nothing of how much more
    a bigger tree would have taken, so the next step tries the next larger candidate, once; this
    happens only where the drafter is doing well. Deterministic."""

    def __init__(
        self,
        candidates: tuple[int, ...],
        warmup: int = 3,
        explore_every: int = 20,
        decay: float = 0.9,
        plain: bool = True,
    ) -> None:
        if not candidates or min(candidates) < 0:
            raise ValueError(f"budget candidates must be >= 0 (0: plain), got {candidates}")
        if warmup < 1 or explore_every < 2 or not 0.0 <= decay < 1.0:
            raise ValueError("need warmup >= 1, explore_every >= 2 and 0 <= decay < 1")
        cands = set(candidates) | ({PLAIN} if plain else set())
        self.candidates = tuple(sorted(cands))
        self.warmup, self.explore_every, self.decay = warmup, explore_every, decay
        self._est: dict[tuple[int, int], _Candidate] = {}
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, bucket: int) -> int:
        st = self._buckets.setdefault(bucket, _Bucket())
        fresh = [c for c in self.candidates if self._get(bucket, c).seconds.n < self.warmup]
        if fresh:  # measuring every candidate is exploring too
            st.since_explore = 0.0
            return fresh[-1]
        rates = self.rates(bucket)
        best = max(self.candidates, key=lambda c: (rates[c], -c))
        larger = [c for c in self.candidates if c > best]
        if st.grow and larger:
            st.grow, st.since_explore = False, 0.0
            return larger[0]
        others = [c for c in reversed(self.candidates) if c != best]
        if others:
            nxt = others[st.turn % len(others)]
            behind = rates[best] / max(rates[nxt], 1e-9 * rates[best], 1e-30)  # R / r >= 1
            wait = self.explore_every * self._get(bucket, nxt).seconds.value * behind
            if st.since_explore >= wait:
                st.turn += 1
                st.since_explore = 0.0
                return nxt
        return best

    def best(self, bucket: int) -> int:
        """The candidate with the highest measured rate (ties: the smaller tree)."""
        rates = self.rates(bucket)
        return max(self.candidates, key=lambda c: (rates[c], -c))

    def record(
        self,
        bucket: int,
        budget: int,
        tokens_per_stream: float,
        seconds: float,
        tokens_at: Mapping[int, float] | None = None,
        saturated: bool = False,
    ) -> None:
        """One step at `budget`: its tokens per stream and seconds; `tokens_at` (optional, from
        `tokens_at_budgets`) what smaller candidates would have committed in the same step;
        `saturated`: a stream accepted the tree to its full depth (a deeper tree might have
        committed more)."""
        self._get(bucket, budget).seconds.update(seconds, self.decay)
        self._buckets.setdefault(bucket, _Bucket()).grow = saturated
        seen = {b: t for b, t in (tokens_at or {}).items() if b < budget and b in self.candidates}
        seen[budget] = tokens_per_stream
        below = None  # the next smaller candidate
        for c in self.candidates:
            if c in seen:
                est = self._get(bucket, c)
                est.tokens.update(seen[c], self.decay)
                if below is None or below in seen:
                    est.gain.update(
                        seen[c] - (seen[below] if below is not None else 0.0), self.decay
                    )
            below = c
        self._buckets.setdefault(bucket, _Bucket()).since_explore += seconds

    def snapshot(self) -> dict[int, int]:
        """bucket -> the budget it currently prefers (buckets seen so far; 0: plain decoding)."""
        return {b: self.best(b) for b in sorted(self._buckets)}

    def rates(self, bucket: int) -> dict[int, float]:
        """candidate -> committed tokens per stream per second (0.0: not yet measured)."""
        rates, below = {}, 0.0  # the next smaller candidate's tokens per step
        for c in self.candidates:
            est = self._get(bucket, c)
            tokens = below + est.gain.value if est.gain.n else est.tokens.value
            measured = est.tokens.n and est.seconds.n and est.seconds.value > 0
            rates[c] = tokens / est.seconds.value if measured else 0.0
            below = tokens if est.tokens.n else below
        return rates

    def _get(self, bucket: int, budget: int) -> _Candidate:
        return self._est.setdefault((bucket, budget), _Candidate())


def tokens_at_budgets(
    outs: Iterable[StepOutput], budget: int, candidates: Iterable[int]
) -> dict[int, float]:
    """Mean tokens per stream each candidate b <= `budget` would have emitted in this step.

    A stream's accepted draft rows increase along the path (parents come before children), and
    the b-node tree is the first b rows of this one, so at b the walk takes the accepted rows
    up to the first one beyond b, plus the bonus; never more than the stream emitted (a stop
    ends both). Exact up to ties among draft scores."""
    outs = list(outs)
    if not outs:
        return {}
    result = {}
    for b in candidates:
        if b > budget:
            continue
        total = 0
        for out in outs:
            accepted = next((i for i, r in enumerate(out.accepted_rows) if r > b), None)
            accepted = len(out.accepted_rows) if accepted is None else accepted
            total += min(1 + accepted, len(out.tokens))
        result[b] = total / len(outs)
    return result


def default_candidates(engine_budget: int) -> tuple[int, ...]:
    """Tree budgets: powers of two from 4 up to the engine's budget, and the engine's budget
    itself (the tuner adds plain decoding, budget 0)."""
    return tuple(
        sorted({b for b in (4, 8, 16, 32, 64, 128) if b <= engine_budget} | {engine_budget})
    )
