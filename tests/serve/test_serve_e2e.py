"""End to end: the README's `ddserve serve` (embedded tiny model, tp=2 over gloo, real Ray Serve)
on 127.0.0.1, driven by the unmodified `openai` client and raw HTTP.

The server starts once for the module (~30-40 s on 2 cores). Expected text comes from
ModelRunner's plain autoregressive greedy decoding in this process (tp=1, float32: the server's
CPU dtype), not from the serving code, and, for the first test, from a `--no-speculative`
server run before this one starts. The dead-shard test runs next to last: it kills a shard (the
replica rebuilds its tensor-parallel group); the last SIGKILLs the CLI itself.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from pathlib import Path

import http_exactness as exactness
import httpx
import openai
import pytest
from kill_probe import measure_kill
from serve_proc import ddserve_env, kill_session, session_leftovers, session_pids, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 240


@pytest.fixture(scope="module")
def served():
    """`ddserve serve` with its defaults, in a session of its own (serve_proc.Server)."""
    try:
        srv = start_server(env=ddserve_env(RAY_AUTH_MODE="disabled"), startup_s=STARTUP_S)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()
        kill_session(srv.proc.pid)  # only if the SIGKILL test failed half-way


@pytest.fixture(scope="module")
def server(served):
    """(url, its Ray's address, pid)."""
    return served.url, served.gcs, served.proc.pid


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ddtree_reference():
    """sample(prompt_ids, max_tokens, **sampling) -> token ids from a tp=1 float32 ModelRunner
    decoding with DDTree as the server does (bundled drafter, budget 16 at batch size 1). At
    T > 0 DDTree matches plain sampling in distribution, not token for token: the tree shape
    enters the per-node draws."""
    import torch

    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.model.tiny import default_model_dir
    from ddserve.sampling import SamplingParams

    torch.set_num_threads(1)
    path = default_model_dir()
    runner = ModelRunner(path, engine_cfg=EngineConfig(num_slots=8192, budget=16,
                         dtype="float32"), drafter=path / "drafter", device="cpu")  # fmt: skip

    def sample(ids: list[int], max_tokens: int, **sampling) -> list[int]:
        runner.add_stream("s", ids, SamplingParams(max_tokens=max_tokens, **sampling))
        out = runner.prefill()["s"]
        toks = list(out.tokens)
        while out.finished is None:
            out = runner.ddtree_step(["s"], 16)["s"]
            toks += out.tokens
        return toks

    return sample


@pytest.fixture(scope="module")
def reference():
    """greedy(prompt_ids, max_tokens) -> (token ids, finish) from a tp=1 float32 ModelRunner."""
    import torch

    from ddserve.engine.config import EngineConfig
    from ddserve.engine.runner import ModelRunner
    from ddserve.model.tiny import default_model_dir
    from ddserve.sampling import SamplingParams
    from ddserve.tokenizer import Tokenizer

    torch.set_num_threads(1)
    path = default_model_dir()
    runner = ModelRunner(path, engine_cfg=EngineConfig(num_slots=8192, dtype="float32"),
                         device="cpu")  # fmt: skip
    counter = iter(range(10**6))

    def greedy(ids: list[int], max_tokens: int, **sampling) -> tuple[list[int], str]:
        sid = next(counter)
        runner.add_stream(sid, ids, SamplingParams(max_tokens=max_tokens, **sampling))
        out = runner.prefill()[sid]
        toks = list(out.tokens)
        while out.finished is None:
            out = runner.ar_step([sid])[sid]
            toks += out.tokens
        return toks, out.finished

    greedy.tok = Tokenizer.from_dir(path)
    return greedy


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = _metrics(url)
        idle = m["ddserve_kv_slots_used"] == 0 and m["ddserve_active_streams"] == 0
        if (idle and m["ddserve_queue_depth"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.2)


def test_served_ddtree_equals_served_plain_decoding_under_other_traffic(request) -> None:
    """First, so that no two servers run at once (a second private Ray on the machine took
    100 s to start, measured): greedy completions of `ddserve serve --no-speculative` given the
    prompts one at a time equal this module's DDTree server's given them all at once, so that
    they share verify batches and prefill forwards (tests/http_exactness.py's check)."""
    texts = exactness.prompts(6)
    plain = exactness.serve_and_run(["--no-speculative"], texts, 24, concurrent=False,
                                    startup_s=300)  # fmt: skip
    url = request.getfixturevalue("url")  # the module's server starts now
    ddtree = asyncio.run(exactness.run(url, texts, 24, concurrent=True))
    diffs = [exactness.first_diff(a, b) for a, b in zip(ddtree, plain, strict=True)]
    assert diffs == [None] * 6, diffs
    assert all(len(t) > 0 for t in ddtree)  # real completions compared


def test_readme_serve_command_answers_a_streaming_request(url: str) -> None:
    body = '{"model": "ddserve-code-21m", "prompt": "Hello", "max_tokens": 16, "stream": true}'
    if shutil.which("curl"):  # the README's way
        cmd = ["curl", "-sSN", "--fail-with-body", "-m", "60", f"{url}/v1/completions",
               "-H", "Content-Type: application/json", "-d", body]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    else:
        r = httpx.post(f"{url}/v1/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        out = r.text
    events = [ln for ln in out.splitlines() if ln]
    assert events[-1] == "data: [DONE]" and len(events) >= 2
    assert all(e.startswith("data: {") for e in events[:-1])
    assert httpx.get(f"{url}/health").status_code == 200


def test_completions_equal_greedy_autoregressive_output(client, model_name, reference) -> None:
    prompt = "The quick brown fox"
    toks, finish = reference(reference.tok.encode(prompt, add_bos=True), 24)
    want = reference.tok.decode(toks)
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == len(toks)
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == want


def test_seeded_sampling_equals_the_runner_with_the_same_seed(
    client, model_name, reference, ddtree_reference
) -> None:
    ids = reference.tok.encode("Once upon a time", add_bos=True)
    toks = ddtree_reference(ids, 20, temperature=0.8, top_p=0.9, seed=7)
    texts = [
        client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=20,
                                  temperature=0.8, top_p=0.9, seed=seed).choices[0].text
        for seed in (7, 7, 8)
    ]  # fmt: skip
    assert texts[0] == texts[1] == reference.tok.decode(toks)
    assert texts[2] != texts[0]


def test_chat_completions_equal_greedy_autoregressive_output(client, model_name, reference):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = reference.tok.encode(reference.tok.apply_chat_template(msgs), add_bos=False)
    toks, _ = reference(ids, 20)
    want = reference.tok.decode(toks)
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=20,
                                       temperature=0)  # fmt: skip
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=20,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_eight_concurrent_streams_finish_with_correct_output(url, model_name, reference) -> None:
    prompts = [f"Request {i}: tell me about item {i * 7}." for i in range(8)]
    lengths = [12 + 3 * i for i in range(8)]
    want = [
        reference(reference.tok.encode(p, add_bos=True), n)
        for p, n in zip(prompts, lengths, strict=True)
    ]

    async def one(c: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, object]:
        stream = await c.completions.create(model=model_name, prompt=prompt, max_tokens=n,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            text += "".join(ch.text for ch in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def run_all() -> list:
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*[one(c, p, n) for p, n in zip(prompts, lengths, strict=True)])

    results = asyncio.run(run_all())
    for p, (toks, _), (text, usage) in zip(prompts, want, results, strict=True):
        assert text == reference.tok.decode(toks)
        assert usage.prompt_tokens == len(reference.tok.encode(p, add_bos=True))
        assert usage.completion_tokens == len(toks)
    m = _wait_idle(url)
    assert m["ddserve_kv_slots_used"] == 0 and m["ddserve_kv_slots_total"] > 0
    assert m["ddserve_accepted_tokens_per_step"] >= 1.0
    assert m["ddserve_committed_tokens_total"] >= sum(lengths) - 8  # prefill makes 1 each


def _err(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"].lower()
    assert all(w.lower() in message for w in words), message


def test_bad_inputs_get_4xx_with_a_clear_message(url: str, model_name: str) -> None:
    post = lambda body: httpx.post(f"{url}/v1/completions", json={"model": model_name, **body})
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x",',
                   headers={"content-type": "application/json"})  # fmt: skip
    _err(r, 400, "json")
    _err(post({"prompt": "x", "max_tokens": "ten"}), 400, "max_tokens")
    _err(post({"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _err(post({"prompt": "x", "max_tokens": 10**6}), 400, "max_tokens", "context")
    _err(post({"prompt": "y" * 5000}), 400, "prompt", "context")
    _err(post({"prompt": "x", "n": 3}), 400, "n=3")
    _err(httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "nope")
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model_name, "messages": "hi"})
    _err(r, 400, "messages")


def test_cancelled_streams_leave_no_kv_slot_in_use(url: str, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Cancel me", "max_tokens": 1500, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    async def one(c: httpx.AsyncClient, wait_for_text: bool) -> None:
        async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            if not wait_for_text:
                return  # disconnect while possibly still queued
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text":"' in line:
                    return  # disconnect mid-stream

    async def run_all() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            await asyncio.gather(*[one(c, i % 2 == 0) for i in range(20)])

    asyncio.run(run_all())
    m = _wait_idle(url)
    assert m["ddserve_kv_slots_used"] == 0
    assert m["ddserve_active_streams"] == 0 and m["ddserve_queue_depth"] == 0
    assert m['ddserve_requests_total{status="cancelled"}'] >= 20


def test_server_keeps_serving_after_all_of_it(client, model_name, reference) -> None:
    toks, _ = reference(reference.tok.encode("Still alive?", add_bos=True), 10)
    r = client.completions.create(model=model_name, prompt="Still alive?", max_tokens=10,
                                  temperature=0)  # fmt: skip
    assert r.choices[0].text == reference.tok.decode(toks)


def test_load_test_against_the_embedded_server(url: str, tmp_path) -> None:
    """Issue 7's acceptance run: loadtest, 16 requests at concurrency 4, against this server."""
    import json

    from loadtest.run import main as loadtest

    out = tmp_path / "load.json"
    args = ["--url", url, "--no-progress", "--out", str(out), "--num-prompts", "16",
            "--concurrency", "4", "--warmup", "2", "--ignore-eos", "--input-len", "8",
            "--output-len", "12"]  # fmt: skip
    t0 = time.perf_counter()
    assert loadtest(args) == 0
    wall = time.perf_counter() - t0
    [run] = json.loads(out.read_text())["runs"]
    reqs = run["requests"]
    assert run["failed"] == 0 and run["completed"] == len(reqs) == 16
    for r in reqs:
        assert r["ok"] and r["usage_reported"] and 0 < r["ttft_s"] <= r["e2e_s"], r
        assert r["output_tokens"] == 12  # ignore_eos: exactly max_tokens, as `usage` reports
    dur = run["duration_s"]
    assert 0 < dur <= wall
    assert run["output_throughput"] == pytest.approx(16 * 12 / dur)
    assert run["server"]["accepted_tokens_per_step"] >= 1.0


def test_a_burst_of_max_streams_plus_max_queue_is_admitted_and_one_more_gets_429(url, model_name):
    """Into an idle server: 10 streams decode and 64 wait (the defaults) without a 429, though
    waiting requests move into free stream slots only between steps; request 75 is refused."""
    held = 10 + 64
    body = {"model": model_name, "prompt": "Burst", "max_tokens": 1500, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip

    async def run_all() -> tuple[list[int], httpx.Response]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as c:
            streams = [c.stream("POST", f"{url}/v1/completions", json=body) for _ in range(held)]
            opened = await asyncio.gather(*[s.__aenter__() for s in streams])
            try:  # every one is admitted (its headers came after the ack) and none can finish yet
                extra = await c.post(f"{url}/v1/completions", json={**body, "stream": False})
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)
            return [r.status_code for r in opened], extra

    codes, extra = asyncio.run(run_all())
    assert codes == [200] * held
    assert extra.status_code == 429 and int(extra.headers["retry-after"]) >= 1
    m = _wait_idle(url)
    assert m["ddserve_active_streams"] == 0 and m["ddserve_queue_depth"] == 0


RECOVERY_S = 90  # the CPU default on the 2-core CI machine: ~13 s measured (bench/recovery.py)


def test_a_killed_shard_is_rebuilt_while_clients_get_fast_503s(server, model_name) -> None:
    """Last: kill -9 of shard rank 1 under an open stream. The stream ends with an SSE error at
    once; new requests get 503 + Retry-After, each answered fast (none hangs), until the replica
    has rebuilt its tensor-parallel group; the old router and shards are gone."""
    url, _, pid = server
    r = measure_kill(url, model_name, "shard", pid, interval=0.2, timeout=5.0, max_wait=RECOVERY_S)
    assert r["in_flight"]["end"] == "error" and r["in_flight"]["after_s"] < 2.0, r["in_flight"]
    failed = [p for p in r["probes"] if p["status"] != 200]
    assert failed, "no request saw the rebuild"  # a rebuild reloads the weights: seconds
    assert {p["status"] for p in failed} == {503}, failed  # 0 would be a hang (no answer in 5 s)
    assert all(int(p["retry_after"]) >= 1 for p in failed)
    # Fast, not waiting on the rebuild (9-13 s here): the new shards import torch and load
    # weights on the same 2 cores meanwhile, so allow a loaded CI machine's jitter.
    answers = sorted(p["answer_s"] for p in failed)
    assert answers[-1] < 4.0 and answers[len(answers) // 2] < 1.0, answers
    assert r["first_success_s"] is not None and r["first_success_s"] < RECOVERY_S
    assert r["after"] == {"routers": 1, "shards": 2}
    assert httpx.get(f"{url}/health").status_code == 200
    m = _metrics(url)
    assert m["ddserve_healthy"] == 1 and m["ddserve_engine_rebuilds_total"] == 1


EXIT_S = 30  # the CLI's exit after a signal (measured 0.2-3.5 s)
CLEAN_S = 30  # every process of its session gone (measured 4-7 s: the reaper's grace period)


def test_sigkill_of_the_cli_leaves_no_ray_process(served) -> None:
    """Last: SIGKILL of the `ddserve serve` process (its reaper stops the Ray it started). On
    this module's server, so that no other server starts for it (test_serve_signals.py has the
    SIGTERM cases)."""
    sid = served.proc.pid  # its own session
    assert len(session_pids(sid)) > 3  # the CLI, GCS, raylet, agents, workers
    served.proc.send_signal(signal.SIGKILL)
    assert served.proc.wait(EXIT_S) == -signal.SIGKILL
    assert session_leftovers(sid, CLEAN_S) == []
