"""End-to-end: the load generator against a streaming OpenAI-compatible server on 127.0.0.1.

By default the server is `tests/fake_openai_server.py`, started in a thread; it logs what it sent,
so token counts and the accepted-tokens-per-step figure are checked against the server's own
record. Set LOADTEST_URL=http://127.0.0.1:8000 (e.g. a running `ddserve serve`) to run the
server-agnostic checks against a real server instead; the fake-only checks then skip.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.run import main

try:
    from fake_openai_server import FakeOpenAIServer
except ImportError:  # tests/ imported as a package
    from tests.fake_openai_server import FakeOpenAIServer

pytestmark = pytest.mark.timeout(120)
REAL_URL = os.environ.get("LOADTEST_URL")


@pytest.fixture(scope="module")
def server():
    """(base URL, the fake server or None when LOADTEST_URL points at a real one)."""
    if REAL_URL:
        yield REAL_URL, None
        return
    with FakeOpenAIServer() as fake:
        yield fake.url, fake


def _run(url: str, tmp_path: Path, *extra: str) -> tuple[int, dict, float]:
    out = tmp_path / "result.json"
    t = time.perf_counter()
    rc = main(["--url", url, "--no-progress", "--out", str(out), *extra])
    wall = time.perf_counter() - t
    return rc, json.loads(out.read_text()), wall


def _check_consistent(run: dict, wall: float) -> None:
    """Figures of one run agree with each other and with the per-request rows."""
    reqs = run["requests"]
    assert run["failed"] == 0 and run["cancelled"] == 0 and run["errors"] == {}
    assert run["completed"] == len(reqs) == run["num_prompts"]
    for r in reqs:
        assert r["ok"] and r["usage_reported"], r
        assert 0 < r["ttft_s"] <= r["e2e_s"], r
        assert r["output_tokens"] >= 1 and r["chunks"] >= 1
    dur = run["duration_s"]
    assert max(r["start_s"] + r["e2e_s"] for r in reqs) == pytest.approx(dur, abs=1e-6)
    assert 0 < dur <= wall
    total_out = sum(r["output_tokens"] for r in reqs)
    total_in = sum(r["prompt_tokens"] for r in reqs)
    assert run["total_output_tokens"] == total_out
    assert run["output_throughput"] == pytest.approx(total_out / dur)
    assert run["total_token_throughput"] == pytest.approx((total_in + total_out) / dur)
    assert run["request_throughput"] == pytest.approx(len(reqs) / dur)
    assert run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]


def _check_against_server_log(run: dict, fake: FakeOpenAIServer) -> None:
    """Every request's token counts equal what the server sent; the accepted length too."""
    log = {row["id"]: row for row in fake.log}
    reqs = run["requests"]
    for r in reqs:
        assert r["output_tokens"] == log[r["id"]]["completion_tokens"]
        assert r["prompt_tokens"] == log[r["id"]]["prompt_tokens"]
    steps = sum(log[r["id"]]["steps"] for r in reqs)
    committed = sum(log[r["id"]]["completion_tokens"] for r in reqs)
    assert run["server"]["stream_steps"] == steps and run["server"]["committed_tokens"] == committed
    assert run["server"]["accepted_tokens_per_step"] == pytest.approx(committed / steps)


def test_small_load_at_concurrency_4(server, tmp_path):
    url, fake = server
    args = ["--num-prompts", "16", "--concurrency", "4", "--warmup", "2", "--ignore-eos"]
    rc, result, wall = _run(url, tmp_path, *args, "--input-len", "8", "--output-len", "12")
    assert rc == 0
    [run] = result["runs"]
    assert run["concurrency"] == 4 and result["config"]["model"]
    _check_consistent(run, wall)
    assert {r["output_tokens"] for r in run["requests"]} == {12}  # ignore_eos: exactly max_tokens
    if fake is not None:
        _check_against_server_log(run, fake)
        assert run["server"]["accepted_tokens_per_step"] > 1  # the fake commits 1-3 per step


def test_chat_endpoint_counts_tokens_from_usage(server, tmp_path):
    url, fake = server
    args = ["--endpoint", "chat", "--num-prompts", "8", "--concurrency", "3", "--output-len", "10"]
    rc, result, wall = _run(url, tmp_path, *args, "--input-len", "6", "--range-ratio", "0.5")
    assert rc == 0
    [run] = result["runs"]
    _check_consistent(run, wall)
    if fake is not None:
        _check_against_server_log(run, fake)


def test_open_loop_poisson_rate(server, tmp_path):
    url, fake = server
    args = ["--request-rate", "100", "--concurrency", "8", "--num-prompts", "10"]
    rc, result, wall = _run(url, tmp_path, *args, "--output-len", "6", "--input-len", "4")
    assert rc == 0
    [run] = result["runs"]
    assert run["request_rate"] == 100
    _check_consistent(run, wall)


def test_sweep_writes_json_and_png(server, tmp_path):
    url, _ = server
    plot = tmp_path / "plots" / "sweep.png"
    args = ["--sweep", "1,2,4", "--num-prompts", "6", "--output-len", "8", "--input-len", "4"]
    rc, result, wall = _run(url, tmp_path, *args, "--ignore-eos", "--plot", str(plot))
    assert rc == 0
    assert [r["concurrency"] for r in result["runs"]] == [1, 2, 4]
    for run in result["runs"]:
        _check_consistent(run, wall)
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(plot)
    assert img.shape[0] > 200 and img.shape[1] > 600
    assert img[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.skipif(REAL_URL is not None, reason="failure injection needs the fake server")
def test_failures_are_counted_with_their_errors(server, tmp_path):
    url, _ = server
    prompts = tmp_path / "p.jsonl"
    rows = ["fine prompt", "<fail> please", "one two three", "boom <fail-midstream>"]
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in rows))
    args = ["--dataset", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "4"]
    rc, result, _ = _run(url, tmp_path, *args, "--concurrency", "2")
    assert rc == 1  # a failed request makes the exit status non-zero
    [run] = result["runs"]
    assert run["completed"] == 2 and run["failed"] == 2
    errors = " | ".join(run["errors"])
    assert "HTTP 500" in errors and "error event" in errors
    assert run["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"] if r["ok"])


@pytest.mark.skipif(REAL_URL is not None, reason="needs the fake server's pace")
def test_duration_bound_cancels_and_stops(server, tmp_path):
    url, fake = server
    args = ["--duration", "0.3", "--num-prompts", "50", "--concurrency", "2", "--ignore-eos"]
    rc, result, wall = _run(url, tmp_path, *args, "--output-len", "400")
    [run] = result["runs"]
    assert run["timed_out"] and run["cancelled"] >= 1
    assert run["completed"] + run["failed"] + run["cancelled"] < 50
    assert run["duration_s"] == pytest.approx(0.3)
    assert wall < 5.0
    # Cancelled streams close server-side too, once the server notices the disconnects. The fake
    # server counts a stream as active until its async generator is finalized, which after a
    # disconnect happens when the abandoned generator is garbage-collected: collect while waiting,
    # and allow a loaded 2-core CI machine time.
    deadline = time.monotonic() + 20
    while fake.active and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert fake.active == 0


def test_refuses_a_remote_host_without_sending(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--url", "http://192.0.2.1:8000", "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("module", ["loadtest", "loadtest.run"])
def test_module_entry_points_print_help(module):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--sweep" in proc.stdout and "--allow-remote" in proc.stdout


def test_unreachable_server_exits_with_status_2(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["--url", f"http://127.0.0.1:{port}", "--no-progress"])
    assert rc == 2
