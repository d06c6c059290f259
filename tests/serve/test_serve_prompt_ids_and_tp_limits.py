"""Second-review regressions: prompt ids past the model's vocabulary, tp > visible GPUs."""

from __future__ import annotations

import pytest
import torch
from serve_fakes import ByteTok

from ddserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from ddserve.serve.requests import ApiError, prepare_chat, prepare_completion

MODEL_VOCAB = 258  # the model's embedding rows; the tokenizer below knows more ids


class WideTok(ByteTok):
    """Kimi-like: the tokenizer's special block runs past the model's embedding; '!' spelled in
    text with allow_special becomes special id 259 (>= MODEL_VOCAB)."""

    vocab_size = 300

    def encode(self, text: str, add_bos: bool = False, allow_special: bool | None = None):
        return [259 if (c == ord("!") and allow_special) else c for c in text.encode()]


def test_text_prompt_with_a_special_id_past_the_model_vocab_is_a_400() -> None:
    # an id >= the embedding's rows crashes the lookup (tp = 1) or silently embeds zeros (tp > 1)
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionRequest(prompt="hi!"), "m", WideTok(), 64, MODEL_VOCAB)
    assert e.value.status == 400
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi!"}])
    ids, _, _ = prepare_chat(req, "m", WideTok(), 64, MODEL_VOCAB)
    assert 259 not in ids and ord("!") in ids  # message text cannot spell control tokens

    class BangTemplate(WideTok):  # the template itself emits the out-of-range control token
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "!" + "".join(m["content"] for m in messages)

    with pytest.raises(ApiError) as e:
        prepare_chat(req, "m", BangTemplate(), 64, MODEL_VOCAB)
    assert e.value.status == 400
    ids, _, _ = prepare_completion(CompletionRequest(prompt="hi"), "m", WideTok(), 64, MODEL_VOCAB)
    assert ids == list(b"hi")


def test_tp_larger_than_the_visible_gpus_fails_before_any_worker_starts(monkeypatch) -> None:
    # a worker that cannot set_device(rank) dies while rank 0 waits in NCCL init forever
    from ddserve.engine import tp

    monkeypatch.setattr(tp, "_is_cuda", lambda kw: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(tp.mp, "get_context", lambda *a: pytest.fail("spawned workers"))
    with pytest.raises(ValueError, match="GPU"):
        tp.TPGroup(2, {"device": "cuda"})
