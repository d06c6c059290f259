"""What a CPU user gets without choosing: float32 compute (`resolve_dtype`, one rule for `LLM()`,
`ddserve generate` and serving), and a text prompt encoded to the same ids offline and over HTTP
(`encode_prompt`: BOS first when the tokenizer has one)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from ddserve import LLM
from ddserve.distributed import LocalComm
from ddserve.engine.config import EngineConfig, resolve_dtype
from ddserve.engine.runner import ModelRunner
from ddserve.model.loader import load_model
from ddserve.serve.protocol import CompletionRequest
from ddserve.serve.requests import prepare_completion
from ddserve.tokenizer import Tokenizer, encode_prompt

TEXT = "Hello <|im_end|> world"  # a spelled special token: parsed on both paths


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", num_slots=256, max_streams=2)


def test_auto_dtype_is_float32_on_the_cpu_and_bfloat16_on_gpus() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", torch.device("cuda", 1)) == "bfloat16"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"  # an explicit choice stands
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu")


def test_llm_on_the_cpu_computes_in_float32(llm) -> None:
    runner = llm.runner
    assert runner.cfg.dtype == "float32" and runner.kv.pool.dtype == torch.float32
    weights = [p for p in runner.model.parameters() if p.is_floating_point()]
    assert {p.dtype for p in weights} == {torch.float32}


def test_a_runner_around_a_built_model_takes_the_model_dtype(tiny_model_dir) -> None:
    model, cfg = load_model(tiny_model_dir, LocalComm(), torch.bfloat16, torch.device("cpu"))
    runner = ModelRunner.from_model(model, cfg)
    assert runner.cfg.dtype == "bfloat16" and runner.kv.pool.dtype == torch.bfloat16


def test_a_text_prompt_gives_the_same_ids_offline_and_over_http(llm) -> None:
    tok = llm.tokenizer
    http, _, _ = prepare_completion(CompletionRequest(prompt=TEXT), "m", tok, ctx=1024)
    offline = llm.encode(TEXT)
    assert offline == http == encode_prompt(tok, TEXT)
    assert offline[0] == tok.bos_token_id and tok.eos_token_id is not None
    assert llm.generate(TEXT, speculative=False)[0].prompt_token_ids == offline


def test_no_bos_is_added_when_the_tokenizer_has_none(tiny_model_dir) -> None:
    tok = Tokenizer(HFTokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), {})
    assert tok.bos_token_id is None
    http, _, _ = prepare_completion(CompletionRequest(prompt=TEXT), "m", tok, ctx=1024)
    assert http == encode_prompt(tok, TEXT) == tok.encode(TEXT, allow_special=True)
