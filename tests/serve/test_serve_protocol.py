"""Request parsing and response shapes, checked against the `openai` package's own types."""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from pydantic import ValidationError
from serve_fakes import ByteTok

from ddserve.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from ddserve.serve.requests import (
    CHAT_DEFAULT_MAX_TOKENS,
    ApiError,
    prepare_chat,
    prepare_completion,
)


def test_extra_fields_are_accepted_and_kept() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "metadata": {"k": "v"}, "foo": [1]})
    assert req.model_extra == {"metadata": {"k": "v"}, "foo": [1]}


def test_stop_accepts_a_string_or_a_list() -> None:
    assert CompletionRequest(prompt="x", stop="##").stop_strings() == ["##"]
    assert CompletionRequest(prompt="x", stop=["a", "", "b"]).stop_strings() == ["a", "b"]
    assert CompletionRequest(prompt="x").stop_strings() == []


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_k": -1},
        {"max_tokens": "many"},
        {"stream": "maybe"},
        # strict types, as OpenAI's: no coercion of booleans, strings or fractions
        {"max_tokens": True},
        {"max_tokens": "5"},
        {"max_tokens": 5.5},
        {"max_tokens": 5.0},
        {"n": True},
        {"seed": "7"},
        {"seed": 2**63},
        {"top_k": "3"},
        {"best_of": 1.0},
        {"stream": "yes"},
        {"stream": 1},
        {"echo": "true"},
        {"ignore_eos": 0},
        {"stream_options": {"include_usage": "yes"}},
        {"stop_token_ids": [True]},
        {"stop_token_ids": ["5"]},
        {"prompt": [1, True]},
        {"prompt": [[1.0, 2]]},
        {"temperature": "0.5"},
        {"temperature": True},
        {"top_p": False},
    ],
)
def test_out_of_range_sampling_fields_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", **bad})


def test_chat_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].text() == "ab"


@pytest.mark.parametrize(
    "part, words",
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, ["'image_url'"]),
        ({"type": "input_audio", "input_audio": {}}, ["'input_audio'"]),
        ({"text": "no type"}, ["has no 'type'"]),
        ({"type": 5, "text": "x"}, ["has type '5'"]),
        ({"type": "text"}, ["string 'text'"]),
        ({"type": "text", "text": 5}, ["string 'text'"]),
    ],
)
def test_non_text_content_parts_are_refused_by_name(part: dict, words: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
def test_known_roles_are_accepted(role: str) -> None:
    ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": "x"}]})


@pytest.mark.parametrize("role", ["tool", "function", "wizard", "User", "user<|im_end|>", ""])
def test_other_roles_are_refused(role: str) -> None:
    with pytest.raises(ValidationError, match="role"):
        ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": "x"}]})


def test_developer_messages_reach_the_template_as_system() -> None:
    req = ChatCompletionRequest(messages=[{"role": "developer", "content": "be brief"}])
    ids, _, _ = prepare_chat(req, "m", ByteTok(), 100)
    assert bytes(ids).decode() == "<system>be brief\n<assistant>"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7
    )
    assert req.requested_max_tokens() == 7


def test_prepare_completion_maps_sampling_fields() -> None:
    req = CompletionRequest(
        prompt="hey",
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop_token_ids=[5],
        ignore_eos=True,
        stop=["q"],
    )
    ids, params, stops = prepare_completion(req, "m", ByteTok(), 32)
    assert ids == list(b"hey") and stops == ["q"]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (
        4,
        0.7,
        0.9,
        3,
        11,
    )
    assert params.stop_token_ids == (5,) and params.ignore_eos


def test_completions_default_to_16_tokens_within_the_context() -> None:
    _, params, _ = prepare_completion(CompletionRequest(prompt="hey"), "m", ByteTok(), 100)
    assert params.max_tokens == 16
    _, params, _ = prepare_completion(CompletionRequest(prompt="hey"), "m", ByteTok(), 10)
    assert params.max_tokens == 7


def test_chat_defaults_to_the_rest_of_the_context_capped_at_4096_tokens() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    ids, params, _ = prepare_chat(req, "m", ByteTok(), 100)
    assert len(ids) + params.max_tokens == 100  # a short context: the rest of it
    ids, params, _ = prepare_chat(req, "m", ByteTok(), 3 * CHAT_DEFAULT_MAX_TOKENS)
    assert params.max_tokens == CHAT_DEFAULT_MAX_TOKENS  # a long one: the cap
    assert len(ids) + CHAT_DEFAULT_MAX_TOKENS < 3 * CHAT_DEFAULT_MAX_TOKENS
    explicit = ChatCompletionRequest(messages=req.messages, max_tokens=5000)
    _, params, _ = prepare_chat(explicit, "m", ByteTok(), 3 * CHAT_DEFAULT_MAX_TOKENS)
    assert params.max_tokens == 5000  # the cap applies to the default only


def test_single_prompt_in_a_list_is_accepted() -> None:
    ids, _, _ = prepare_completion(CompletionRequest(prompt=["ab"]), "m", ByteTok(), 32)
    assert ids == [97, 98]
    ids, _, _ = prepare_completion(CompletionRequest(prompt=[[1, 2]]), "m", ByteTok(), 32)
    assert ids == [1, 2]


def test_model_may_be_omitted_but_not_wrong() -> None:
    prepare_completion(CompletionRequest(prompt="x"), "m", ByteTok(), 32)
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionRequest(prompt="x", model="other"), "m", ByteTok(), 32)
    assert e.value.status == 404 and e.value.param == "model"


def test_prompt_filling_the_context_is_rejected() -> None:
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionRequest(prompt="x" * 8), "m", ByteTok(), 8)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_floats_accept_integers() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 1})
    assert (req.temperature, req.top_p) == (0.0, 1.0)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a\ud800"},
        {"prompt": ["\udfff"]},
        {"prompt": "x", "stop": "\ud800"},
        {"prompt": "x", "stop": ["ok", "\ud800"]},
        {"prompt": "x", "model": "\ud800"},
        {"prompt": "x", "user": "\ud800"},
        {"prompt": "x", "suffix": "\ud800"},
    ],
)
def test_lone_surrogates_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError, match="surrogate U\\+D[89A-F]"):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "hi \ud800"},
        {"role": "user\ud800", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "\udbff"}]},
        {"role": "user", "content": "hi", "name": "\ud800"},
    ],
)
def test_lone_surrogates_in_chat_messages_are_refused(message: dict) -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        ChatCompletionRequest.model_validate({"messages": [message]})


def test_prompt_character_limit_is_checked_before_tokenizing() -> None:
    class Refuses(ByteTok):
        def encode(self, *a, **kw):
            raise AssertionError("tokenized")

    req = CompletionRequest(prompt="x" * 11)
    with pytest.raises(ApiError) as e:
        prepare_completion(req, "m", Refuses(), 100, max_prompt_chars=10)
    assert (e.value.status, e.value.param, e.value.code) == (
        400,
        "prompt",
        "string_above_max_length",
    )
    chat = ChatCompletionRequest(
        messages=[{"role": "system", "content": "x" * 6}, {"role": "user", "content": "y" * 5}]
    )
    with pytest.raises(ApiError) as e:
        prepare_chat(chat, "m", Refuses(), 100, max_prompt_chars=10)
    assert e.value.param == "messages" and "11 characters" in e.value.message


def test_prompt_token_limit() -> None:
    req = CompletionRequest(prompt="abcdef")
    prepare_completion(req, "m", ByteTok(), 100, max_prompt_tokens=6)
    with pytest.raises(ApiError) as e:
        prepare_completion(req, "m", ByteTok(), 100, max_prompt_tokens=5)
    assert e.value.code == "context_length_exceeded" and "at most 5" in e.value.message
    with pytest.raises(ApiError):  # token-id prompts are counted too
        prepare_completion(
            CompletionRequest(prompt=[1] * 6), "m", ByteTok(), 100, max_prompt_tokens=5
        )


def test_responses_parse_as_openai_types() -> None:
    u = Usage.of(3, 4)
    assert u.total_tokens == 7
    c = CompletionResponse(
        id="c",
        created=1,
        model="m",
        usage=u,
        choices=[CompletionChoice(text="hi", finish_reason="length")],
    )
    assert Completion.model_validate(c.model_dump()).choices[0].text == "hi"
    chat = ChatCompletionResponse(
        id="c",
        created=1,
        model="m",
        usage=u,
        choices=[ChatChoice(message=ChatResponseMessage(content="yo"), finish_reason="stop")],
    )
    assert ChatCompletion.model_validate(chat.model_dump()).choices[0].message.content == "yo"
    chunk = ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
    )
    assert OpenAIChunk.model_validate(chunk.model_dump()).choices[0].delta.role == "assistant"
    last = ChatCompletionChunk(id="c", created=1, model="m", choices=[], usage=u)
    assert OpenAIChunk.model_validate(last.model_dump()).usage.completion_tokens == 4


def test_chat_without_a_chat_template_is_a_400() -> None:
    class NoTemplate(ByteTok):
        def apply_chat_template(self, messages: list[dict]) -> str:
            raise ValueError("tokenizer_config.json has no chat_template")

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ApiError) as e:
        prepare_chat(req, "m", NoTemplate(), 32)
    assert e.value.status == 400 and "chat_template" in e.value.message


def test_stop_lists_are_bounded() -> None:
    """Every streamed token is checked against each stop string: list and items are capped."""
    from pydantic import ValidationError

    from ddserve.serve.protocol import MAX_STOP_CHARS, MAX_STOPS

    CompletionRequest(prompt="x", stop=["a"] * MAX_STOPS)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stop=["a"] * (MAX_STOPS + 1))
    with pytest.raises(ValidationError, match="characters"):
        CompletionRequest(prompt="x", stop="a" * (MAX_STOP_CHARS + 1))
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stop_token_ids=list(range(65)))


# ---- bounded lists: pydantic checks a list's length before validating its items -------------


def test_messages_are_bounded() -> None:
    from ddserve.serve.protocol import MAX_MESSAGES

    ChatCompletionRequest(messages=[{"role": "user"}] * MAX_MESSAGES)
    with pytest.raises(ValidationError, match=f"at most {MAX_MESSAGES} items"):
        ChatCompletionRequest(messages=[{"role": "user"}] * (MAX_MESSAGES + 1))


def test_content_parts_are_bounded() -> None:
    from ddserve.serve.protocol import MAX_CONTENT_PARTS

    part = {"type": "text", "text": "x"}
    ChatCompletionRequest(messages=[{"role": "user", "content": [part] * MAX_CONTENT_PARTS}])
    with pytest.raises(ValidationError, match=f"at most {MAX_CONTENT_PARTS} items"):
        ChatCompletionRequest(
            messages=[{"role": "user", "content": [part] * (MAX_CONTENT_PARTS + 1)}]
        )


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], ["a"] * 100_000])
def test_a_list_of_several_prompts_is_refused_by_the_schema(prompt: list) -> None:
    with pytest.raises(ValidationError, match=f"only one prompt per request.*got {len(prompt)}"):
        CompletionRequest(prompt=prompt)


@pytest.mark.parametrize("nested", [False, True])
def test_prompt_token_ids_are_bounded(nested: bool) -> None:
    from ddserve.serve.protocol import MAX_PROMPT_IDS

    def prompt(n: int) -> list:
        return [[1] * n] if nested else [1] * n

    CompletionRequest(prompt=prompt(MAX_PROMPT_IDS))
    with pytest.raises(ValidationError, match=f"at most {MAX_PROMPT_IDS} token ids"):
        CompletionRequest(prompt=prompt(MAX_PROMPT_IDS + 1))


def test_the_openapi_schema_states_the_list_bounds() -> None:
    from ddserve.serve.protocol import MAX_MESSAGES, MAX_PROMPT_IDS

    prompt = CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"]
    assert [b.get("maxItems") for b in prompt] == [None, MAX_PROMPT_IDS, 1, 1]
    messages = ChatCompletionRequest.model_json_schema()["properties"]["messages"]
    assert messages["maxItems"] == MAX_MESSAGES


# ---- what the server cannot honour is a 400 naming the field --------------------------------

CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("logit_bias", {"50256": -100}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("top_logprobs", 2),
    ],
)
def test_unsupported_openai_fields_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ApiError) as e:
        prepare_chat(ChatCompletionRequest(**CHAT, **{field: value}), "m", ByteTok(), 32)
    assert (e.value.status, e.value.param) == (400, field)
    assert f"'{field}' is not supported" in e.value.message
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionRequest(prompt="x", **{field: value}), "m", ByteTok(), 32)
    assert (e.value.status, e.value.param) == (400, field)


def test_unsupported_fields_at_their_no_op_values_are_served() -> None:
    nothing = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
               "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
               "top_logprobs": 0, "functions": None, "function_call": "none"}  # fmt: skip
    ids, _, _ = prepare_chat(ChatCompletionRequest(**CHAT, **nothing), "m", ByteTok(), 32)
    assert ids


def test_stream_options_without_stream_are_refused() -> None:
    req = CompletionRequest(prompt="x", stream_options={"include_usage": True})
    with pytest.raises(ApiError, match="only allowed when 'stream' is enabled") as e:
        prepare_completion(req, "m", ByteTok(), 32)
    assert e.value.param == "stream_options"
    streamed = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    prepare_completion(streamed, "m", ByteTok(), 32)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_zero_token_limit_names_the_field_it_came_from(field: str) -> None:
    with pytest.raises(ApiError) as e:
        prepare_chat(ChatCompletionRequest(**CHAT, **{field: 0}), "m", ByteTok(), 32)
    assert e.value.param == field and e.value.message.startswith(f"{field} must be at least 1")


def test_an_unknown_model_is_not_echoed_whole() -> None:
    with pytest.raises(ApiError) as e:
        prepare_completion(CompletionRequest(prompt="x", model="g" * 100_000), "m", ByteTok(), 32)
    assert e.value.status == 404 and len(e.value.message) < 200
