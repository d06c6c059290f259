"""The load generator's parsers and generators: SSE, chunks, Prometheus text, prompts, arrivals."""

from __future__ import annotations

import json
import statistics

import pytest

from loadtest import datasets
from loadtest.client import SSEDecoder, Target, build_body, chunk_text
from loadtest.driver import poisson_gaps
from loadtest.prom import parse_prometheus, server_delta
from loadtest.run import check_url
from loadtest.tokens import TokenCounter


def _events(lines: list[str]) -> list[str]:
    dec = SSEDecoder()
    out = [d for line in lines if (d := dec.feed(line)) is not None]
    tail = dec.flush()
    return out + ([tail] if tail is not None else [])


def test_sse_decoder_splits_events_and_skips_comments():
    lines = [": keep-alive", "", 'data: {"a": 1}', "", "event: x", "data:[DONE]", ""]
    assert _events(lines) == ['{"a": 1}', "[DONE]"]


def test_sse_decoder_joins_multiline_data_and_flushes_the_tail():
    assert _events(["data: a", "data: b", "", "data: last"]) == ["a\nb", "last"]


def test_chunk_text_for_both_endpoints():
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert chunk_text(role, "chat") == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"
    assert chunk_text({"choices": [{"text": " x"}]}, "completions") == " x"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, "completions") == ""


def test_request_body_asks_for_usage_and_fixed_length():
    prompt = datasets.Prompt("hello there", 2, 7)
    body = build_body(Target("http://127.0.0.1:1", "m", "chat", ignore_eos=True), prompt)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True
    body = build_body(Target("http://127.0.0.1:1", "m"), prompt)
    assert body["prompt"] == "hello there" and "ignore_eos" not in body


def test_prometheus_text_sums_label_sets():
    text = "\n".join(
        [
            "# HELP ddserve_steps_total steps",
            "# TYPE ddserve_steps_total counter",
            "ddserve_steps_total 40.0",
            "ddserve_committed_tokens_total 100",
            'ddserve_requests_total{status="ok",route="a b"} 3',
            'ddserve_requests_total{status="error"} 1 1712345678000',
            'ddserve_step_seconds_bucket{le="+Inf"} 40',
        ]
    )
    m = parse_prometheus(text)
    assert m["ddserve_steps_total"] == 40 and m["ddserve_committed_tokens_total"] == 100
    assert m["ddserve_requests_total"] == 4
    assert m["ddserve_step_seconds_bucket"] == 40


def test_accepted_tokens_per_step_is_a_ratio_of_deltas():
    before = {"ddserve_steps_total": 10.0, "ddserve_committed_tokens_total": 12.0}
    after = {"ddserve_steps_total": 30.0, "ddserve_committed_tokens_total": 62.0}
    d = server_delta(before, after)
    assert d["steps"] == 20 and d["committed_tokens"] == 50
    assert d["accepted_tokens_per_step"] == pytest.approx(2.5)
    assert server_delta(None, after) is None
    assert server_delta(after, after)["accepted_tokens_per_step"] is None  # no step ran


def test_accepted_tokens_per_step_counts_stream_steps_when_the_server_has_them():
    """A batched step of 4 streams committing 8 tokens is 2 tokens per stream step, not 8."""
    before = {"ddserve_steps_total": 0.0, "ddserve_stream_steps_total": 0.0,
              "ddserve_committed_tokens_total": 0.0}  # fmt: skip
    after = {"ddserve_steps_total": 1.0, "ddserve_stream_steps_total": 4.0,
             "ddserve_committed_tokens_total": 8.0}  # fmt: skip
    assert server_delta(before, after)["accepted_tokens_per_step"] == pytest.approx(2.0)


def test_step_and_control_time_are_per_batched_step_in_ms():
    before = {"ddserve_steps_total": 5.0, "ddserve_stream_steps_total": 10.0,
              "ddserve_step_seconds_sum": 1.0, "ddserve_control_seconds_sum": 0.25}  # fmt: skip
    after = {"ddserve_steps_total": 25.0, "ddserve_stream_steps_total": 90.0,
             "ddserve_step_seconds_sum": 1.1, "ddserve_control_seconds_sum": 0.27}  # fmt: skip
    d = server_delta(before, after)
    assert d["step_ms_per_step"] == pytest.approx(5.0)  # 0.1 s over 20 steps, not 80 stream steps
    assert d["control_ms_per_step"] == pytest.approx(1.0)
    older = {"ddserve_steps_total": 25.0}  # a server without the histograms
    assert server_delta(older, older)["step_ms_per_step"] is None


def test_random_prompts_respect_range_ratio_and_seed():
    per_word = TokenCounter(per_word=1.0, per_byte=0.0)  # one token per word: exact lengths
    ps = datasets.random_prompts(200, 40, 10, range_ratio=0.5, seed=3, counter=per_word)
    assert all(20 <= p.prompt_len <= 60 and 5 <= p.output_len <= 15 for p in ps)
    assert all(len(p.text.split()) == p.prompt_len for p in ps)
    assert len({p.prompt_len for p in ps}) > 10
    assert ps == datasets.random_prompts(200, 40, 10, 0.5, seed=3, counter=per_word)
    fixed = datasets.random_prompts(5, 8, 4, counter=per_word)
    assert {(p.prompt_len, p.output_len) for p in fixed} == {(8, 4)}


def test_jsonl_and_sharegpt_files(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "one two", "max_tokens": 5}\n\n{"prompt": "three"}\n')
    ps = datasets.jsonl_prompts(jl, default_output_len=9)
    assert [(p.text, p.output_len) for p in ps] == [("one two", 5), ("three", 9)]
    sg = tmp_path / "sg.json"
    convs = [
        {
            "conversations": [
                {"from": "human", "value": "x" * 40},
                {"from": "gpt", "value": "y" * 80},
            ]
        },
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "y" * 80}]},
    ]
    sg.write_text(json.dumps(convs))
    ps = datasets.sharegpt_prompts(sg)
    assert len(ps) == 1 and ps[0].prompt_len == 10 and ps[0].output_len == 20
    assert len(datasets.take(ps, 3)) == 3


def test_poisson_gaps_have_the_requested_rate():
    gaps = poisson_gaps(rate=50.0, n=4000, seed=1)
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.06)
    assert gaps == poisson_gaps(50.0, 4000, seed=1)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:80"]
)
def test_loopback_urls_are_accepted(url):
    assert check_url(url, allow_remote=False) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com", "ftp://127.0.0.1"])
def test_remote_or_odd_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_url(url, allow_remote=False)


def test_remote_url_needs_explicit_permission():
    assert check_url("http://10.0.0.5:8000", allow_remote=True) == "http://10.0.0.5:8000"
