"""The FastAPI app over a fake EngineClient, served by uvicorn on 127.0.0.1 (no Ray, no model)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from serve_fakes import EOS, ByteTok, FakeEngine, serving

from ddserve.serve.app import HttpLimits, ServedModel, create_app

MODEL = "fake-model"
CTX = 64


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(chunk=3, delay=0.002)
    with serving(create_app(engine, ServedModel(MODEL, CTX, ByteTok()))) as base:
        yield base, engine


@pytest.fixture
def url(server) -> str:
    base, engine = server
    engine.queue_full, engine.dead, engine.die_after_tokens = False, None, None
    engine.delay = 0.002
    return base


@pytest.fixture
def engine(server) -> FakeEngine:
    return server[1]


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _repeat(text: str, n: int) -> str:
    return (text * n)[:n]


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=7)
    assert r.choices[0].text == "hellohe"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 7, 12)


def test_completion_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="abcd",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _repeat("abcd", 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    prompt = ByteTok().apply_chat_template(msgs)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9)
    assert r.choices[0].message.content == _repeat(prompt, 9)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt.encode())
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == _repeat(prompt, 9)


def test_max_completion_tokens_and_content_parts(client: openai.OpenAI) -> None:
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4)
    assert r.choices[0].message.content == "<use" and r.usage.completion_tokens == 4


def test_stop_string_cuts_text_and_aborts_engine(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.completions.create(model=MODEL, prompt="abcXYdef", max_tokens=40, stop=["XYd", "zz"])
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abcXYdef", max_tokens=40, stop="XYd", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "abc"
    assert len(engine.aborted) >= 2 and not engine.active


def test_eos_and_stop_token_ids_finish_with_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[97, 98, EOS, 99], max_tokens=10)
    assert r.choices[0].text == "ab" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 3
    r = client.completions.create(
        model=MODEL, prompt=[97, 98, EOS, 99], max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == "abcabcab" and r.usage.completion_tokens == 10
    r = client.completions.create(
        model=MODEL, prompt="abcd", max_tokens=10, extra_body={"stop_token_ids": [99]}
    )
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"


def test_unknown_extra_fields_are_accepted(url: str) -> None:
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "frobnicate": {"x": 1}, "top_k": 5}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


def _err(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    return err


def test_malformed_json_is_400(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    _err(r, 400, "json")


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "hi", "temperature": "hot"}, "temperature", ["temperature"]),
        ({"prompt": 5}, "prompt", ["prompt"]),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ["max_tokens", "at least 1"]),
        ({"prompt": "hi", "max_tokens": CTX}, "max_tokens", ["max_tokens", f"{CTX}"]),
        ({"prompt": "x" * CTX}, "prompt", ["prompt", f"{CTX}"]),
        ({"prompt": "hi", "n": 2}, "n", ["n=2"]),
        ({"prompt": ["a", "b"]}, "prompt", ["one prompt"]),
        ({"prompt": [1, 2, 999]}, "prompt", ["token ids"]),
        ({"prompt": "hi", "logprobs": 3}, "logprobs", ["logprobs"]),
    ],
)
def test_bad_completion_inputs_are_400(url: str, body: dict, param: str, words: list[str]) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body})
    assert _err(r, 400, *words)["param"] == param


def test_bad_chat_inputs_are_400(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert _err(r, 400, "messages")["param"] == "messages"
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL})
    assert _err(r, 400, "messages")["param"] == "messages"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert "gpt-17" in str(e.value) and e.value.body["code"] == "model_not_found"


def test_full_queue_is_429_with_retry_after(url: str, engine: FakeEngine) -> None:
    engine.queue_full = True
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    _err(r, 429, "queue")
    assert r.headers["retry-after"] == "2"


def test_dead_engine_is_503_and_unhealthy(url: str, engine: FakeEngine) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    engine.dead = "shard 1 died"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert "shard" not in _err(r, 503, "retry later")["message"]  # internals: server log only
    assert r.headers["retry-after"].isdigit()
    _err(httpx.get(f"{url}/health"), 503, "retry later")


def test_engine_dying_mid_stream_sends_an_error_event(
    client: openai.OpenAI, engine: FakeEngine
) -> None:
    engine.die_after_tokens = 3
    with pytest.raises(openai.APIError, match="retry later"):
        for _ in client.completions.create(
            model=MODEL, prompt="abcdef", max_tokens=20, stream=True
        ):
            pass


def test_client_disconnect_aborts_the_engine_request(url: str, engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 60, "stream": True}
    n_aborted, engine.delay = len(engine.aborted), 0.05
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 5
    while engine.active and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.active and len(engine.aborted) == n_aborted + 1


def test_models_health_and_metrics(url: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="abc", max_tokens=5)
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['ddserve_requests_total{status="ok"}'] >= 1
    assert samples["ddserve_generation_tokens_total"] >= 5
    assert samples["ddserve_kv_slots_total"] == 1000
    assert "ddserve_kv_slots_used" in samples


def test_sse_wire_format_ends_with_done(url: str) -> None:
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_api_key_over_real_http_with_the_openai_client() -> None:
    app = create_app(FakeEngine(), ServedModel(MODEL, CTX, ByteTok()), HttpLimits(), "sk-right")
    with serving(app) as base:
        right = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-right", max_retries=0)
        assert (
            right.completions.create(model=MODEL, prompt="ab", max_tokens=2).choices[0].text == "ab"
        )
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["code"] == "invalid_api_key" and "sk-wrong" not in str(e.value)
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 401


def test_oversized_body_over_real_http_is_413_in_openai_shape() -> None:
    app = create_app(
        FakeEngine(), ServedModel(MODEL, CTX, ByteTok()), HttpLimits(max_body_bytes=1024)
    )
    with serving(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=2)
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        assert httpx.get(f"{base}/health").status_code == 200
