"""Serving metrics against values worked out by hand on synthetic timelines.

The timelines (seconds):
  A: start 10.0, token chunks at 10.5, 10.7, 11.0, end 11.1, 4 output tokens, 10 prompt tokens
  B: start 10.2, token chunks at 10.4, 10.6,       end 10.6, 2 output tokens, 20 prompt tokens
  C: start 10.3, token chunk  at 10.9,             end 10.9, 1 output token,  30 prompt tokens
  D, E: failed with "HTTP 500: boom"
Hand-computed: TTFT 0.5 / 0.2 / 0.6; E2E 1.1 / 0.4 / 0.6; TPOT (1.1-0.5)/3 = 0.2, (0.4-0.2)/1 =
0.2, none for C (one token); ITL 0.2, 0.3 (A) and 0.2 (B).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.metrics import (
    RequestResult,
    compute_metrics,
    itls,
    percentile,
    request_records,
    summarize_ms,
    tpot,
)


def _timelines() -> list[RequestResult]:
    a = RequestResult(10.0, 11.1, [10.5, 10.7, 11.0], output_len=4, prompt_len=10)
    b = RequestResult(10.2, 10.6, [10.4, 10.6], output_len=2, prompt_len=20)
    c = RequestResult(10.3, 10.9, [10.9], output_len=1, prompt_len=30)
    d = RequestResult(10.1, 10.15, [], prompt_len=40, error="HTTP 500: boom")
    e = RequestResult(10.4, 10.45, [], prompt_len=40, error="HTTP 500: boom")
    return [a, b, c, d, e]


def test_per_request_ttft_e2e_tpot_itl():
    a, b, c, *_ = _timelines()
    assert a.ttft == pytest.approx(0.5) and a.e2e == pytest.approx(1.1)
    assert tpot(a) == pytest.approx(0.2)
    assert tpot(b) == pytest.approx(0.2)
    assert tpot(c) is None
    assert itls(a) == pytest.approx([0.2, 0.3])
    assert itls(c) == []


def test_request_without_tokens_has_no_ttft_or_tpot():
    r = RequestResult(1.0, 2.0, [], output_len=0)
    assert r.ttft is None and tpot(r) is None


def test_percentile_matches_hand_values_and_numpy():
    assert percentile([200, 500, 600], 90) == pytest.approx(580)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([7.0], 99) == 7.0
    rng = random.Random(0)
    for n in (2, 5, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for p in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_is_in_milliseconds_with_population_std():
    s = summarize_ms([0.5, 0.2, 0.6])
    assert s["mean"] == pytest.approx(433.3333, rel=1e-6)
    assert s["median"] == pytest.approx(500)
    assert s["std"] == pytest.approx((86666.6667 / 3) ** 0.5, rel=1e-6)
    assert s["p90"] == pytest.approx(580)
    assert s["p99"] == pytest.approx(598)
    assert summarize_ms([]) is None


def test_run_metrics_on_synthetic_timelines():
    m = compute_metrics(_timelines(), duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 2
    assert m["errors"] == {"HTTP 500: boom": 2}
    assert m["total_input_tokens"] == 60  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(433.3333, rel=1e-6)
    assert m["tpot_ms"]["mean"] == pytest.approx(200) and m["tpot_ms"]["p99"] == pytest.approx(200)
    itl = m["itl_ms"]  # [200, 300, 200]
    assert itl["mean"] == pytest.approx(233.3333, rel=1e-6)
    assert itl["median"] == pytest.approx(200) and itl["p90"] == pytest.approx(280)
    e2e = m["e2e_ms"]  # [1100, 400, 600]
    assert e2e["mean"] == pytest.approx(700) and e2e["median"] == pytest.approx(600)
    assert e2e["p90"] == pytest.approx(1000) and e2e["p99"] == pytest.approx(1090)
    assert m["mean_concurrency"] == pytest.approx(1.05)


def test_all_failed_gives_no_latency_figures():
    m = compute_metrics(_timelines()[3:], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["ttft_ms"] is None and m["tpot_ms"] is None and m["e2e_ms"] is None
    assert m["output_throughput"] == 0


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics(_timelines(), duration_s=0.0)


def test_request_records_are_relative_to_run_start():
    rows = request_records(_timelines()[:2], t0=10.0)
    assert rows[0]["start_s"] == 0.0 and rows[1]["start_s"] == pytest.approx(0.2)
    assert rows[0]["ttft_s"] == pytest.approx(0.5) and rows[0]["tpot_s"] == pytest.approx(0.2)
    assert rows[0]["chunks"] == 3 and rows[0]["ok"]
