"""Response shaping without stages: the tool-call parser (whole and streamed in any split), the request's
grammar constraint and tool signatures, and OpenAI's audio object."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf

from gateway.openai.audio_out import OpenAIAudioOut
from gateway.openai.protocol import parse_chat_request
from gateway.openai.tools import constraint, tools_json
from gateway.tool_calls import ToolCallParser, parse_all
from services.common.pb import thinker_pb2

TEXT = (
    "Let me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"unit":"c","where":{"city":"Paris"}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_whole_output_splits_into_text_and_calls() -> None:
    content, calls = parse_all(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"unit": "c", "where": {"city": "Paris"}}),
        ("noop", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_all("no calls <tool_cal") == ("no calls <tool_cal", [])
    # A block that is no call stays text; a block in another key order is still a call.
    assert parse_all("a <tool_call>oops</tool_call> b") == ("a <tool_call>oops</tool_call> b", [])
    _, (loose,) = parse_all('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert (loose.name, json.loads(loose.arguments)) == ("f", {"x": 1})


def test_a_block_cut_before_its_name_is_given_back_as_generated() -> None:
    """max_tokens may end a constrained call inside its name: the text is what the model wrote, with no
    closing tag that it never wrote; the calls before it stay calls."""
    cut = TEXT + '\n<tool_call>\n{"name": "get_wea'
    content, calls = parse_all(cut)
    assert [c.name for c in calls] == ["get_weather", "noop"]
    assert content == 'Let me check.<tool_call>\n{"name": "get_wea'
    _, (partial,) = parse_all('<tool_call>\n{"name": "f", "arguments": {"x": 1')
    assert (partial.name, partial.arguments) == ("f", '{"x": 1')  # a cut after the name: still a call


@pytest.mark.parametrize("step", [1, 2, 5, 13, len(TEXT)])
def test_streamed_calls_send_id_and_name_first_then_argument_fragments(step: int) -> None:
    parser = ToolCallParser()
    outs = [parser.feed(TEXT[i : i + step]) for i in range(0, len(TEXT), step)]
    outs.append(parser.finish())
    assert "".join(t for t, _ in outs) == "Let me check."
    fragments = [f for _, fs in outs for f in fs]
    args: dict[int, str] = {}
    for f in fragments:
        args[f["index"]] = args.get(f["index"], "") + f["function"].get("arguments", "")
    assert {i: json.loads(a) for i, a in args.items()} == {
        0: {"unit": "c", "where": {"city": "Paris"}},
        1: {},
    }
    for index in (0, 1):
        mine = [f for f in fragments if f["index"] == index]
        assert (
            mine[0]["id"].startswith("call_")
            and mine[0]["type"] == "function"
            and mine[0]["function"]["name"]
        )
        assert all("id" not in f and "name" not in f["function"] for f in mine[1:])


def test_request_side_signatures_and_grammars() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat_request({**base, "tools": [WEATHER], "tool_choice": "required"}, "m")
    assert [json.loads(t) for t in tools_json(req)] == [WEATHER]
    grammar = constraint(req)
    assert grammar is not None and grammar.kind == thinker_pb2.Constraint.KIND_TOOL_CALLS and grammar.parallel
    assert json.loads(grammar.spec) == [{"name": "get_weather", "parameters": {"type": "object"}}]
    auto = parse_chat_request({**base, "tools": [WEATHER]}, "m")
    assert constraint(auto) is None and tools_json(auto)
    none = parse_chat_request({**base, "tools": [WEATHER], "tool_choice": "none"}, "m")
    assert tools_json(none) == [] and constraint(none) is None
    named = parse_chat_request(
        {
            **base,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        "m",
    )
    assert (g := constraint(named)) is not None and not g.parallel
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    js = constraint(parse_chat_request({**base, "response_format": fmt}, "m"))
    assert (
        js is not None
        and js.kind == thinker_pb2.Constraint.KIND_JSON_SCHEMA
        and json.loads(js.spec) == schema
    )
    jo = constraint(parse_chat_request({**base, "response_format": {"type": "json_object"}}, "m"))
    assert jo is not None and jo.kind == thinker_pb2.Constraint.KIND_JSON_OBJECT
    assert constraint(parse_chat_request(base, "m")) is None


def test_openai_audio_object() -> None:
    samples = np.sin(np.linspace(0, 200, 2400)).astype(np.float32) * 0.5
    out = OpenAIAudioOut("pcm16")
    first, second = out.data_delta(samples), out.transcript_delta("hi")
    assert first["id"] == second["id"] and "expires_at" in first and "expires_at" not in second
    assert len(base64.b64decode(first["data"])) == 2 * samples.size and second["transcript"] == "hi"
    for fmt, container in (("wav", "WAV"), ("flac", "FLAC"), ("mp3", "MP3"), ("opus", "OGG")):
        message = OpenAIAudioOut(fmt).message(samples, "words")
        info = sf.info(io.BytesIO(base64.b64decode(message["data"])))
        assert info.format == container and message["transcript"] == "words"
