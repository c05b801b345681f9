"""The chat body's validation layer (gateway/openai/protocol.py): the OpenAI fields of the drop-in contract.

Each field parses into the typed ``ChatRequest`` attribute the route reads, and each bad value is a 400
``invalid_request_error`` whose ``param`` is the exact JSON path the client must fix.
"""

from __future__ import annotations

import pytest

from gateway.openai.body import loads_checked
from gateway.openai.errors import APIError
from gateway.openai.protocol import (
    OpenAIAudio,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolSpec,
    parse_chat_request,
)

MODEL = "openbmb/MiniCPM-o-4_5"
USER = {"role": "user", "content": "what is the weather?"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _req(**extra: object):
    body = {"model": MODEL, "messages": [USER], **extra}
    return parse_chat_request(body, MODEL)


def _refused(param: str, **extra: object) -> APIError:
    with pytest.raises(APIError) as info:
        _req(**extra)
    err = info.value
    assert err.status == 400 and err.param == param, (err.param, err.message)
    assert err.err_type == "invalid_request_error" and err.code, err.code
    return err


def test_defaults_of_the_new_attributes() -> None:
    req = _req()
    assert req.tools == [] and req.tool_choice == ToolChoice("none") and req.parallel_tool_calls is True
    assert req.response_format is None and req.stop == [] and req.logprobs is False
    assert req.top_logprobs is None and req.seed is None and req.openai_audio is None
    assert req.presence_penalty == 0.0 and req.frequency_penalty == 0.0
    assert req.messages[0].tool_calls == [] and req.messages[0].tool_call_id is None


def test_tools_and_tool_choice_parse() -> None:
    req = _req(tools=[WEATHER, {"type": "function", "function": {"name": "noop"}}], parallel_tool_calls=False)
    assert req.tools[0] == ToolSpec(
        "get_weather",
        "current weather",
        WEATHER["function"]["parameters"],
        False,  # type: ignore[index]
    )
    assert req.tools[1].parameters == {"type": "object", "properties": {}}
    assert req.tool_choice == ToolChoice("auto") and req.parallel_tool_calls is False
    forced = _req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced.tool_choice == ToolChoice("function", "get_weather")
    assert _req(tools=[WEATHER], tool_choice="required").tool_choice == ToolChoice("required")
    assert _req(tool_choice="none").tool_choice == ToolChoice("none")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_tool_errors_name_the_param(extra: dict, param: str) -> None:
    _refused(param, **extra)


def test_tool_messages_and_assistant_tool_calls() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    }
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = parse_chat_request({"model": MODEL, "messages": messages, "tools": [WEATHER]}, MODEL)
    assert req.messages[1].tool_calls == [ToolCall("call_1", "get_weather", '{"city":"Oslo"}')]
    assert req.messages[2].role == "tool" and req.messages[2].tool_call_id == "call_1"
    assert req.messages[2].parts[0].text == "sunny"

    def refused(msgs: list, param: str) -> None:
        with pytest.raises(APIError) as info:
            parse_chat_request({"model": MODEL, "messages": msgs}, MODEL)
        assert info.value.status == 400 and info.value.param == param, info.value.message

    refused(
        [*messages[:2], {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
        "messages[2].tool_call_id",
    )
    refused([USER, {"role": "tool", "content": "x"}], "messages[1].tool_call_id")
    bad_args = {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    refused(
        [USER, {"role": "assistant", "tool_calls": [bad_args]}],
        "messages[1].tool_calls[0].function.arguments",
    )
    refused(
        [
            *messages[:2],
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": "x"}]},
        ],
        "messages[2].content[0]",
    )


def test_response_format() -> None:
    assert _req(response_format={"type": "text"}).response_format is None
    assert _req(response_format={"type": "json_object"}).response_format == ResponseFormat("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = _req(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        }
    )
    assert got.response_format == ResponseFormat("json_schema", "out", schema, True)
    _refused("response_format.type", response_format={"type": "yaml"})
    _refused(
        "response_format.json_schema.name",
        response_format={"type": "json_schema", "json_schema": {"name": "a b"}},
    )
    _refused("response_format.json_schema", response_format={"type": "json_schema"})
    err = _refused(
        "response_format.json_schema.schema",
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": 12}}},
    )
    assert "JSON Schema" in err.message
    for bad in ({"$schema": 5}, {"pattern": "["}, {"type": []}):
        _refused(
            "response_format.json_schema.schema",
            response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": bad}},
        )


def test_stop_logprobs_penalties_seed() -> None:
    assert _req(stop="END").stop == ["END"] and _req(stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]
    _refused("stop", stop=["a", "b", "c", "d", "e"])
    _refused("stop", stop="")
    _refused("stop", stop=["a", 3])
    req = _req(logprobs=True, top_logprobs=20, seed=7, presence_penalty=-2, frequency_penalty=1.5)
    assert (req.logprobs, req.top_logprobs, req.seed) == (True, 20, 7)
    assert req.thinker_sampling["seed"] == 7
    assert (req.presence_penalty, req.frequency_penalty) == (-2.0, 1.5)
    _refused("top_logprobs", logprobs=True, top_logprobs=21)
    _refused("top_logprobs", top_logprobs=2)
    _refused("presence_penalty", presence_penalty=2.5)
    _refused("frequency_penalty", frequency_penalty="high")


def test_top_p_zero_is_the_most_likely_token() -> None:
    """OpenAI accepts top_p = 0; the thinker's range is (0, 1], so it goes there as top_k = 1."""
    sampling = _req(top_p=0, top_k=5, temperature=0.7).thinker_sampling
    assert "top_p" not in sampling and sampling["top_k"] == 1 and sampling["temperature"] == 0.7
    assert _req(top_p=0.5).thinker_sampling["top_p"] == 0.5
    _refused("top_p", top_p=-0.1)


def test_openai_audio_object() -> None:
    req = _req(modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"})
    assert req.openai_audio == OpenAIAudio("alloy", "pcm16") and req.audio_format == "pcm"
    assert _req(audio={"voice": "alloy", "format": "mp3"}).openai_audio == OpenAIAudio("alloy", "mp3")
    _refused("audio.format", audio={"voice": "alloy", "format": "aac"})
    _refused("audio.voice", audio={"voice": 3, "format": "wav"})
    _refused("audio.voice", audio={"voice": "", "format": "wav"})


def test_default_modalities_is_a_parse_parameter() -> None:
    body = {"model": MODEL, "messages": [USER]}
    assert parse_chat_request(body, MODEL).modalities == ["text"]
    assert parse_chat_request(body, MODEL, default_modalities=("text", "audio")).modalities == [
        "text",
        "audio",
    ]
    assert parse_chat_request({**body, "modalities": ["audio"]}, MODEL, None, ("text",)).modalities == [
        "audio"
    ]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_tokens_name_their_path(token: str) -> None:
    with pytest.raises(APIError) as info:
        loads_checked(b'{"a": [1, {"b": ' + token.encode() + b"}]}")
    assert info.value.param == "a[1].b" and info.value.code == "invalid_value"


@pytest.mark.parametrize(
    "messages, param, code",
    [
        ([3], "messages[0]", "invalid_type"),
        ([{"content": "hi"}], "messages[0].role", "missing_required_parameter"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": None}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "messages[0].content[0].input_audio.data",
            "missing_required_parameter",
        ),
        (
            [{"role": "user", "content": [{"type": "video_url", "video_url": 7}]}],
            "messages[0].content[0].video_url",
            "invalid_type",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{}"}}],
                },
            ],
            "messages[1].tool_calls[0].id",
            "invalid_value",
        ),
    ],
)
def test_message_errors_carry_path_and_reason(messages: list, param: str, code: str) -> None:
    """The discriminated message/part unions report the failing member's own field, not the union's tag."""
    with pytest.raises(APIError) as info:
        parse_chat_request({"model": MODEL, "messages": messages}, MODEL)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code), info.value.message
    assert info.value.message.startswith(f"'{param}'") and "#" not in info.value.message


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"n": 2}, "n", "unsupported_value"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"model": None}, "model", "missing_required_parameter"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"temperature": 10**400}, "temperature", "invalid_value"),
        ({"modalities": ["text", "video"]}, "modalities", "invalid_value"),
        ({"sampling_params_list": [{"bogus": 1}]}, "sampling_params_list[0].bogus", "invalid_value"),
        ({"sampling_params_list": [{}, 3]}, "sampling_params_list[1]", "invalid_type"),
        ({"extra_body": {"ref_audio": 3}}, "ref_audio", "invalid_type"),
    ],
)
def test_body_errors_carry_path_and_reason(extra: dict, param: str, code: str) -> None:
    err = _refused(param, **extra)
    assert err.code == code, err.code
    assert "ThinkerSampling" not in err.message and "TalkerSampling" not in err.message


def test_every_refusal_is_a_clean_envelope() -> None:
    """Bodies of the wrong shape at each level are 400s with a reason code, never another exception."""
    with pytest.raises(APIError) as info:
        parse_chat_request([USER], MODEL)
    assert (info.value.param, info.value.code) == (None, "invalid_type")
    with pytest.raises(APIError) as info:
        parse_chat_request({"model": "gpt-4o", "messages": 3}, MODEL)
    assert (info.value.status, info.value.code) == (404, "model_not_found")
