"""Serving-benchmark metrics, defined as vLLM's and SGLang's serving benchmarks define them.

All functions are pure: they read `RequestResult` timelines (times in seconds from
`time.perf_counter`) and return numbers. Definitions, per successful request:

- TTFT = first token chunk arrival - request start.
- E2E  = end of the response - request start.
- TPOT = (E2E - TTFT) / (output_len - 1), only for requests with output_len > 1.
- ITL  = gaps between consecutive token-carrying chunks (one list over all requests). A chunk may
  carry several tokens (speculative decoding commits several per step), so ITL >= TPOT there.

Per run: request throughput = completed / duration, output token throughput = output tokens /
duration, total token throughput = (input + output tokens) / duration, where duration is the
benchmark's wall time (first request sent to last request finished; warm-up excluded). Failed
requests count in `failed` with their errors and are left out of every latency and token figure.
Summaries give mean, median, std (population), p90 and p99 (linear interpolation, as numpy's
default percentile), in milliseconds; an empty set gives None, never 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class RequestResult:
    """One request's timeline, as the client saw it."""

    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrivals of token-carrying chunks
    output_len: int = 0  # usage.completion_tokens when reported, else number of token chunks
    prompt_len: int = 0  # usage.prompt_tokens when reported, else the dataset's estimate
    usage_reported: bool = False
    error: str | None = None  # None means success
    request_id: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start


def tpot(r: RequestResult) -> float | None:
    """(E2E - TTFT) / (output_len - 1); None when output_len <= 1 or no token arrived."""
    if r.output_len <= 1 or r.ttft is None:
        return None
    return (r.e2e - r.ttft) / (r.output_len - 1)


def itls(r: RequestResult) -> list[float]:
    """Gaps between consecutive token-carrying chunks of one request."""
    return [b - a for a, b in pairwise(r.chunk_times)]


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean, median, std, p90, p99 of values given in seconds, reported in milliseconds."""
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {
        "mean": mean,
        "median": percentile(ms, 50),
        "std": std,
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """Each distinct error message of the failed requests, with how often it occurred."""
    return dict(Counter(r.error for r in results if r.error is not None).most_common())


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict:
    """Aggregate figures of one run (see the module docstring for the definitions)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in map(tpot, ok) if t is not None]
    all_itls = [gap for r in ok for gap in itls(r)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": error_counts(results),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": summarize_ms(ttfts),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms(all_itls),
        "e2e_ms": summarize_ms([r.e2e for r in ok]),
        # Mean number of requests in flight over the run (SGLang's "concurrency").
        "mean_concurrency": sum(r.e2e for r in ok) / duration_s,
    }


def request_records(results: Sequence[RequestResult], t0: float) -> list[dict]:
    """Per-request rows for the JSON result; times in seconds, starts relative to t0."""
    return [
        {
            "id": r.request_id,
            "ok": r.success,
            "error": r.error,
            "start_s": r.start - t0,
            "ttft_s": r.ttft,
            "e2e_s": r.e2e,
            "tpot_s": tpot(r),
            "prompt_tokens": r.prompt_len,
            "output_tokens": r.output_len,
            "chunks": len(r.chunk_times),
            "usage_reported": r.usage_reported,
        }
        for r in results
    ]
