"""OpenAI-compatible request and response bodies (pydantic; the HTTP edge only).

Requests accept unknown extra fields (clients send many we ignore). Anything we cannot honour
(n > 1, logprobs, best_of, tools, a response_format, logit_bias, penalties, non-text content
parts, tool roles; `ddserve.serve.requests` checks the fields) is rejected with a 400 naming the
field, never silently ignored. Every list is bounded in the schema (`MAX_*`): requests are
validated on the event loop, and pydantic stops at the first item past a list's bound. Types are
as strict as OpenAI's: booleans must be JSON booleans and integers JSON integers (`true`, `"5"`
and `5.5` are refused), floats accept integers. Every text field must be valid Unicode (a lone
surrogate is refused, `Text`). Responses follow the OpenAI wire format so the unmodified `openai`
client parses them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    field_validator,
)

from ddserve.tokenizer import check_unicode


def _valid_unicode(v: str) -> str:
    check_unicode(v)
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]
Float = Annotated[float, Strict()]  # a JSON number: integers are fine, booleans and strings not
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]


def quoted(s: str, limit: int = 40) -> str:
    """`s` for an error message: quoted and shortened, so a huge input is not echoed whole."""
    return repr(s if len(s) <= limit else s[:limit] + "...")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: StrictBool = False


MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_IDS = 16, 256, 64
# OpenAI documents no cap on messages. 4096 is more turns than any real conversation sends (a
# 256k-token context holds 4096 messages of 64 tokens each), and validates in ~10 ms; unbounded,
# the 500k empty messages that fit the 8 MiB body held the event loop for seconds.
MAX_MESSAGES = 4096
# Clients send a few parts per message (text, images); 256 is generous.
MAX_CONTENT_PARTS = 256
# Prompt token ids: 4x the longest context served (256k tokens). The context length is known only
# when the app is created; the requests check it after validation.
MAX_PROMPT_IDS = 1 << 20


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    max_tokens: StrictInt | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    # extension (vLLM/SGLang): 0 disables. Bounded so the engine's int64 tensors hold it.
    top_k: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0
    seed: Int64 | None = None
    # OpenAI allows 4 stop strings; a few more are harmless, an unbounded list is a cost per token
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOPS)] | None = None
    # extension
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_IDS)] | None = None
    ignore_eos: StrictBool = False  # extension
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: Any = None
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptIds = Annotated[list[StrictInt], Field(max_length=MAX_PROMPT_IDS)]


class CompletionRequest(_SamplingFields):
    # A string or token ids, alone or as a list of one: one prompt per request (n == 1).
    prompt: (
        Text
        | PromptIds
        | Annotated[list[Text], Field(max_length=1)]
        | Annotated[list[PromptIds], Field(max_length=1)]
    )
    echo: StrictBool = False
    suffix: Text | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        """The schema's list bounds, said plainly (the union's own errors list every branch)."""
        if not isinstance(v, list) or not v:
            return v
        if len(v) > 1 and isinstance(v[0], str | list):
            raise ValueError(f"only one prompt per request is supported, got {len(v)}")
        ids = v[0] if isinstance(v[0], list) else v
        if len(ids) > MAX_PROMPT_IDS:
            raise ValueError(f"at most {MAX_PROMPT_IDS} token ids, got {len(ids)}")
        return v


# The roles a chat message may have. "developer" is OpenAI's newer name for instructions that
# outrank the user; the chat templates we serve know only "system", so it is sent as "system".
# Tool roles are refused: this server has no tool calling, so there are no tool calls to answer.
CHAT_ROLES = ("system", "developer", "user", "assistant")
TEMPLATE_ROLE = {"developer": "system"}


ContentParts = Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)]


class ChatMessage(_Request):
    role: Text
    content: Text | ContentParts | None = None
    name: Text | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v in ("tool", "function"):
            raise ValueError(f"the '{v}' role is not supported: this server has no tool calling")
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {quoted(v)}: expected one of {', '.join(CHAT_ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: str | list[dict[str, Any]] | None) -> Any:
        for i, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type")
            if kind != "text":
                what = "has no 'type'" if kind is None else f"has type {quoted(str(kind))}"
                raise ValueError(
                    f"content part {i} {what}: only 'text' parts are supported "
                    "(this model reads text only)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"content part {i} needs a string 'text'")
            check_unicode(text)
        return v

    def template_role(self) -> str:
        """The role as the chat template knows it ("developer" -> "system")."""
        return TEMPLATE_ROLE.get(self.role, self.role)

    def text(self) -> str:
        """The message's text: a string, or the concatenated text parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = None

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# ---- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Both the whole response and, with stream=True, each SSE chunk (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: FinishReason = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "ddserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
