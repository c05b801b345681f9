"""The OpenAI drop-in surface through the stock ``openai`` SDK against real stage processes (tiny
checkpoint, CPU): tool calling (required, named, streamed, follow-up turns), structured outputs
(``parse()`` with a pydantic model, json_object), stop strings, logprobs, usage details, the default
text-only output, and both audio dialects. Random weights: the grammars make calls and JSON valid."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import soundfile as sf
from gateway_server import ThreadedGateway
from pydantic import BaseModel, Field
from stage_processes import start_stages, stop_all

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {"thinker": {"sampling": {"max_tokens": 24}}, "talker": {"sampling": {"max_new_frames": 40}}}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
NOOP: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "noop",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


class Forecast(BaseModel):
    unit: Literal["c", "f"]
    rain: bool
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def gateway(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    procs = start_stages(
        tiny_ckpt,
        tmp_path_factory.mktemp("dropin_logs"),
        [("thinker", ["--max-context", "1024"]), ("talker", []), ("code2wav", [])],
    )
    addrs = {p.stage: p.addr for p in procs}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu").with_overrides(OVERRIDES))
    try:
        with ThreadedGateway(config) as gw:
            yield gw
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def client(gateway: ThreadedGateway) -> Any:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", timeout=300, max_retries=0)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_required_tool_call_then_a_follow_up_turn(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=_user("Weather?"),
        tools=[WEATHER, NOOP],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "noop": NOOP}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert 0 <= (r.usage.prompt_tokens_details.cached_tokens or 0) <= r.usage.prompt_tokens
    assert r.usage.completion_tokens_details is not None
    # The follow-up: the call and its result go back through the chat template.
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            *_user("Weather?"),
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ],
        tools=[WEATHER, NOOP],
        tool_choice="none",
        max_tokens=6,
    )
    assert follow.choices[0].finish_reason == "length"
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_named_tool_call_streams_id_and_name_first(client: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Weather?"),
        tools=[WEATHER, NOOP],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None


def test_parse_with_a_pydantic_model_and_json_object(client: Any) -> None:
    r = client.chat.completions.parse(
        model=MODEL, messages=_user("Forecast?"), response_format=Forecast, max_tokens=60
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    assert r.choices[0].message.content == parsed.model_dump_json()  # compact, in schema order
    j = client.chat.completions.create(
        model=MODEL, messages=_user("JSON please"), response_format={"type": "json_object"}, max_tokens=40
    )
    text = j.choices[0].message.content or ""
    assert text.startswith("{") and " " not in text.split('"')[0]


def test_stop_logprobs_and_text_only_default(client: Any, gateway: ThreadedGateway) -> None:
    ref = client.chat.completions.create(model=MODEL, messages=_user("Say it."), max_tokens=24)
    text = ref.choices[0].message.content or ""
    assert ref.choices[0].message.audio is None  # no modalities: text only
    assert len(text) > 10
    stop = text[4:9]
    cut = client.chat.completions.create(
        model=MODEL, messages=_user("Say it."), max_tokens=24, stop=[stop], logprobs=True, top_logprobs=2
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = cut.choices[0].logprobs
    assert lp is not None and lp.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes is not None for t in lp.content)
    streamed = client.chat.completions.create(
        model=MODEL, messages=_user("Say it."), max_tokens=24, stop=stop, stream=True, logprobs=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(stop)]
    assert any(c.choices[0].logprobs and c.choices[0].logprobs.content for c in chunks if c.choices)
    # Raw HTTP: no modalities means no audio chunk at all.
    body = {"model": MODEL, "messages": _user("hi"), "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=300) as resp:
        lines = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert {c.get("modality") for c in lines} == {"text"}


_LOOKAHEAD = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=x)y$"}}}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_logit_bias_and_refused_fields_through_the_sdk(client: Any) -> None:
    """logit_bias reaches the thinker's sampler (+100 forces its token at every step); a token id beyond
    the vocabulary and a refused or unknown field come back as 400s naming the field."""
    forced = client.chat.completions.create(
        model=MODEL, messages=_user("Say it."), max_tokens=5, logit_bias={"9707": 100}, logprobs=True
    )
    lp = forced.choices[0].logprobs
    assert lp is not None and len(lp.content) == 5 and len({t.token for t in lp.content}) == 1
    assert forced.choices[0].message.content == lp.content[0].token * 5
    for kwargs, param in (
        ({"logit_bias": {"999999999": 5}}, "logit_bias.999999999"),
        ({"store": True}, "store"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        # a schema the grammar engine refuses (look-ahead): the thinker's refusal names the client's field
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _LOOKAHEAD}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": [_tool(_LOOKAHEAD)], "tool_choice": "required"}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=2, **kwargs)
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == param, body


def test_openai_audio_dialect_and_the_vllm_omni_one(client: Any, gateway: ThreadedGateway) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Speak."),
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=12,
        stream=True,
    )
    chunks = [c.model_dump() for c in stream]
    audio = [c["choices"][0]["delta"].get("audio") for c in chunks if c["choices"]]
    audio = [a for a in audio if a]
    data = b"".join(base64.b64decode(a["data"]) for a in audio if a.get("data"))
    transcript = "".join(a.get("transcript") or "" for a in audio)
    assert len(data) > 0 and len(data) % 2 == 0
    assert transcript and len({a["id"] for a in audio}) == 1
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    full = client.chat.completions.create(
        model=MODEL,
        messages=_user("Speak."),
        modalities=["text", "audio"],
        audio={"voice": "verse", "format": "wav"},
        max_tokens=12,
    )
    msg = full.choices[0].message
    assert msg.audio is not None and msg.content is None
    assert msg.audio.transcript == transcript  # greedy: the same words as the stream
    samples, rate = sf.read(io.BytesIO(base64.b64decode(msg.audio.data)))
    assert rate == 24000 and samples.ndim == 1 and np.abs(samples).max() > 0
    # No ``audio`` object: the vLLM-Omni dialect (base64 WAV chunks in delta.content).
    body = {
        "model": MODEL,
        "messages": _user("Speak."),
        "modalities": ["audio"],
        "stream": True,
        "max_tokens": 8,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=300) as resp:
        lines = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    audio_chunks = [
        c for c in lines if c.get("modality") == "audio" and c["choices"][0]["delta"].get("content")
    ]
    assert audio_chunks and all("audio" not in c["choices"][0]["delta"] for c in audio_chunks)
    first = base64.b64decode(audio_chunks[0]["choices"][0]["delta"]["content"])
    assert first[:4] == b"RIFF"
