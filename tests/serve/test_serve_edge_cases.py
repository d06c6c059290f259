"""Serving-edge bugs found in review: each test states the behaviour a user relies on.

The HTTP app runs in-process over httpx's ASGI transport against small fake engines (no Ray).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import jinja2
import pytest
import torch
from serve_fakes import ByteTok, FakeEngine

from ddserve.actors.client import RequestRejected, TokenDelta
from ddserve.actors.router import RouterConfig
from ddserve.actors.shard import ShardSpec
from ddserve.engine.config import EngineConfig
from ddserve.sampling import SamplingParams
from ddserve.serve.app import ServedModel, create_app
from ddserve.serve.deployment import ServeConfig
from ddserve.serve.protocol import CompletionRequest
from ddserve.serve.requests import prepare_completion
from ddserve.tokenizer import Tokenizer, write_byte_tokenizer

MODEL, CTX = "m", 64


def _post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def _app(engine=None, tok=None):
    return create_app(engine or FakeEngine(chunk=3), ServedModel(MODEL, CTX, tok or ByteTok()))


def _sse_json(r: httpx.Response) -> list[dict]:
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"]


# ---- input validation -----------------------------------------------------------------------


def test_top_k_beyond_int64_is_a_400_not_an_engine_crash() -> None:
    # The engine builds torch int64 tensors from top_k; 1e20 overflowed there, on every shard,
    # which killed the whole replica. Any top_k that passes validation must fit a tensor.
    r = _post(_app(), "/v1/completions", {"prompt": "hi", "top_k": 10**20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    req = CompletionRequest(prompt="hi", top_k=2**31 - 1)
    _, params, _ = prepare_completion(req, MODEL, ByteTok(), CTX)
    torch.tensor([params.top_k])  # fits


def test_chat_template_errors_are_a_400(tmp_path) -> None:
    # HF chat templates reject bad conversations with raise_exception(...) (a jinja error here).
    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(jinja2.TemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    r = _post(
        _app(tok=tok), "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "roles must alternate" in r.json()["error"]["message"]


def test_completions_work_for_a_tokenizer_without_bos(tmp_path) -> None:
    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    r = _post(_app(tok=tok), "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "abc" and r.json()["usage"]["prompt_tokens"] == 3


# ---- usage with stop strings ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_tokens_up_to_the_one_completing_the_stop_string(stream: bool) -> None:
    # The fake engine commits 3 tokens per delta (like a DDTree step accepting 3). Plain AR
    # decoding would stop after the token that completes "b": 2 completion tokens, whatever
    # the engine's step size. Usage must not depend on how many tokens a step accepted.
    body = {"prompt": "abcdef", "max_tokens": 10, "stop": "b", "stream": stream}
    if stream:  # OpenAI refuses stream_options without stream (so does ddserve)
        body["stream_options"] = {"include_usage": True}
    r = _post(_app(FakeEngine(chunk=3)), "/v1/completions", body)
    assert r.status_code == 200
    if stream:
        chunks = _sse_json(r)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    else:
        text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
    assert text == "a"
    assert usage["completion_tokens"] == 2 and usage["total_tokens"] == 8


# ---- engine errors after the admission ack --------------------------------------------------


class _RejectingEngine(FakeEngine):
    """Acks admission, then rejects (what the Router does when a shard refuses a stream)."""

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        yield TokenDelta()
        raise RequestRejected("request does not fit in the KV cache")


def test_rejection_after_the_ack_is_a_400_not_a_500() -> None:
    r = _post(_app(_RejectingEngine()), "/v1/completions", {"prompt": "hi"})
    assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"]


def test_rejection_after_the_ack_sends_an_error_event_when_streaming() -> None:
    r = _post(_app(_RejectingEngine()), "/v1/completions", {"prompt": "hi", "stream": True})
    errors = [e["error"] for e in _sse_json(r) if "error" in e]
    assert errors and "KV cache" in errors[0]["message"] and errors[0]["code"] == "request_rejected"


# ---- deployment config ----------------------------------------------------------------------


def test_max_queue_zero_is_refused_rather_than_answering_every_request_429() -> None:
    # Every request passes through the waiting queue, so max_queue=0 rejects all of them.
    with pytest.raises(ValueError, match="max_queue"):
        ServeConfig.model_validate({"max_queue": 0})
    with pytest.raises(ValueError, match="max_queue"):
        RouterConfig(shard=ShardSpec(model_path="m"), max_queue=0)


@pytest.mark.parametrize(
    "kw",
    [
        {"buckets": (1, 2, 4, 8, 12, 16), "budgets": (16, 8, 0, 4, 4, 4)},  # budget 0
        {"buckets": (1, 2, 4, 8, 12, 16), "budgets": (16, 8, -1, 4, 4, 4)},
        {"buckets": (0, 4, 16)},
        {"buckets": (16, 1, 8)},  # unsorted: 1 stream would be padded to 16
    ],
)
def test_bad_buckets_or_budgets_fail_at_config_time_not_at_the_first_step(kw: dict) -> None:
    with pytest.raises(ValueError):
        engine = EngineConfig(budget=16, max_streams=8, graph_buckets=kw["buckets"])
        RouterConfig(shard=ShardSpec(model_path="m", engine=engine), budgets=kw.get("budgets"))


def test_serve_config_http_limits_default_to_http_limits_own() -> None:
    from ddserve.serve.app import HttpLimits

    assert ServeConfig().http_limits() == HttpLimits()
    cfg = ServeConfig.model_validate({"max_body_bytes": 1000, "max_prompt_tokens": 50})
    assert cfg.http_limits() == HttpLimits(1000, HttpLimits().max_prompt_chars, 50)


def test_api_key_is_read_from_the_named_variable_and_an_unset_one_fails_without_a_value(
    monkeypatch,
) -> None:
    assert ServeConfig().api_key() is None  # no variable named: no key
    cfg = ServeConfig.model_validate({"api_key_env": "DDSERVE_TEST_KEY"})
    monkeypatch.setenv("DDSERVE_TEST_KEY", "")
    with pytest.raises(ValueError, match="DDSERVE_TEST_KEY is unset or empty") as e:
        cfg.api_key()
    assert "\n" not in str(e.value)
    monkeypatch.setenv("DDSERVE_TEST_KEY", "k-123")
    assert cfg.api_key() == "k-123"
