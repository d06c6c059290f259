"""From a validated request body to what the engine runs: prompt ids, SamplingParams, stop strings.

Every rejection is an `ApiError` naming the offending field, so the client learns what to fix.
Prompt text is measured in characters before it is tokenized (`max_prompt_chars`), and in tokens
after (`max_prompt_tokens` when set, and always the context length: a prompt must leave room for
one generated token). These functions tokenize: the app runs them on a worker thread, never on
the event loop.
"""

from __future__ import annotations

from typing import Any

import jinja2

from ddserve.sampling import SamplingParams
from ddserve.serve.chat import encode_chat
from ddserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    quoted,
)
from ddserve.tokenizer import encode_prompt

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's chat default is "the rest of the context". Admission reserves a stream's worst case in
# KV slots, so that default would let one request reserve a long-context pool whole and serialize
# every other stream behind it; chat requests without a limit get this many tokens at most.
CHAT_DEFAULT_MAX_TOKENS = 4096


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


NO_TOOLS = "this server has no tool calling"
# OpenAI fields this server cannot honour: (the values that ask for nothing, why another is refused)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), NO_TOOLS),
    "tool_choice": ((None, "none"), NO_TOOLS),
    "functions": ((None, []), NO_TOOLS),
    "function_call": ((None, "none"), NO_TOOLS),
    "response_format": ((None, {"type": "text"}), 'only {"type": "text"} output is supported'),
    "logit_bias": ((None, {}), "logit bias is not supported"),
    "presence_penalty": ((None, 0), "penalties are not supported"),
    "frequency_penalty": ((None, 0), "penalties are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
}


def _check_common(req: _SamplingFields, served: str) -> None:
    if req.model is not None and req.model != served:
        raise ApiError(
            404,
            f"The model {quoted(req.model)} does not exist; this server serves '{served}'.",
            param="model",
            code="model_not_found",
        )
    if req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported: only n=1.", param="n")
    if req.logprobs not in (None, False):
        raise ApiError(400, "logprobs are not supported.", param="logprobs")
    extra = req.model_extra or {}
    for field, (no_op, why) in UNSUPPORTED.items():
        if extra.get(field) not in no_op:
            raise ApiError(400, f"'{field}' is not supported: {why}.", param=field)
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )


def _check_chars(n_chars: int, max_chars: int | None, param: str) -> None:
    if max_chars is not None and n_chars > max_chars:
        raise ApiError(
            400,
            f"The prompt has {n_chars} characters; this server accepts at most {max_chars}.",
            param=param,
            code="string_above_max_length",
        )


def _check_tokens(n_prompt: int, max_tokens: int | None, param: str) -> None:
    if max_tokens is not None and n_prompt > max_tokens:
        raise ApiError(
            400,
            f"The prompt has {n_prompt} tokens; this server accepts at most {max_tokens} "
            "prompt tokens.",
            param=param,
            code="context_length_exceeded",
        )


def _params(
    req: _SamplingFields,
    max_tokens: int | None,
    n_prompt: int,
    ctx: int,
    default_max: int | None,
    max_param: str = "max_tokens",
) -> SamplingParams:
    """`max_param`: the field `max_tokens` came from (chat: or `max_completion_tokens`)."""
    if n_prompt == 0:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    if n_prompt >= ctx:
        raise ApiError(
            400,
            f"The prompt has {n_prompt} tokens; this model's maximum context "
            f"length is {ctx} tokens.",
            param="prompt",
            code="context_length_exceeded",
        )
    room = ctx - n_prompt
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if max_tokens < 1:
        raise ApiError(400, f"{max_param} must be at least 1, got {max_tokens}.", param=max_param)
    if max_tokens > room:
        raise ApiError(
            400,
            f"{max_param}={max_tokens} is too large: the prompt has {n_prompt} "
            f"tokens and this model's maximum context length is {ctx} tokens, so at "
            f"most {room} can be generated.",
            param=max_param,
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def _vocab(tok: Any, model_vocab: int | None) -> int | None:
    """Ids must fit both the tokenizer and the model's embedding (they can differ: Kimi's
    tokenizer reserves 258 special ids past a 163584-token BPE, its embedding has 163840 rows)."""
    known = [v for v in (getattr(tok, "vocab_size", None), model_vocab) if v is not None]
    return min(known) if known else None


def _check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"Token ids in '{param}' must be in [0, {vocab_size}).", param=param)


def prepare_completion(
    req: CompletionRequest,
    served: str,
    tok: Any,
    ctx: int,
    model_vocab: int | None = None,
    *,
    max_prompt_chars: int | None = None,
    max_prompt_tokens: int | None = None,
) -> tuple[list[int], SamplingParams, list[str]]:
    _check_common(req, served)
    for field in ("echo", "suffix"):
        if getattr(req, field):
            raise ApiError(400, f"'{field}' is not supported.", param=field)
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported.", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list of one prompt (the schema refuses more)
    vocab = _vocab(tok, model_vocab)
    if isinstance(prompt, str):  # the offline engine's ids for the same text
        _check_chars(len(prompt), max_prompt_chars, "prompt")
        ids = encode_prompt(tok, prompt)
    else:
        ids = [int(t) for t in prompt]
    _check_tokens(len(ids), max_prompt_tokens, "prompt")
    _check_token_ids(ids, vocab, "prompt")  # spelled specials can lie past the model's vocab
    _check_token_ids(list(req.stop_token_ids or ()), vocab, "stop_token_ids")
    params = _params(req, req.max_tokens, len(ids), ctx, COMPLETION_DEFAULT_MAX_TOKENS)
    return ids, params, req.stop_strings()


def prepare_chat(
    req: ChatCompletionRequest,
    served: str,
    tok: Any,
    ctx: int,
    model_vocab: int | None = None,
    *,
    max_prompt_chars: int | None = None,
    max_prompt_tokens: int | None = None,
) -> tuple[list[int], SamplingParams, list[str]]:
    _check_common(req, served)
    messages = [{"role": m.template_role(), "content": m.text()} for m in req.messages]
    _check_chars(sum(len(m["content"]) for m in messages), max_prompt_chars, "messages")
    try:  # the template's control tokens become ids; message text cannot forge them
        ids = encode_chat(tok, messages)
    except (ValueError, jinja2.TemplateError) as e:  # no template, or it refused the messages
        raise ApiError(
            400,
            f"Cannot build a chat prompt for this model: {e}. Use "
            "/v1/completions with a plain prompt.",
            param="messages",
        ) from e
    _check_tokens(len(ids), max_prompt_tokens, "messages")
    vocab = _vocab(tok, model_vocab)
    _check_token_ids(ids, vocab, "messages")  # spelled specials can lie past the model's vocab
    _check_token_ids(list(req.stop_token_ids or ()), vocab, "stop_token_ids")
    given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.requested_max_tokens()
    params = _params(req, max_tokens, len(ids), ctx, CHAT_DEFAULT_MAX_TOKENS, given)
    return ids, params, req.stop_strings()
