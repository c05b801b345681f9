"""Realtime function calling through the REAL stages (docs/realtime.md, Function tools), on both lanes.

The gateway runs under uvicorn on loopback in front of real thinker, talker and code2wav processes on the
tiny checkpoint (CPU), seeded. The random-weight model never writes a call of its own, so the tests force
one (``tool_choice`` required or a named function): the thinker decodes it under the chat route's
tool-call grammar, so its arguments parse and follow the schema whatever the weights. The client's result
(``function_call_output``) then goes back to the model before its next unit. Every server event of the
module is checked against the response invariants and the stock ``openai`` SDK's GA models, and one
session runs through the SDK's own realtime connection with warnings as errors.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from realtime_ga import ga_model, ga_problems
from realtime_helpers import pcm16_b64, tone, wav_data_uri
from realtime_invariants import check_response_invariants
from realtime_stages import Conn, RunningStages, closing_session, realtime_gateway, stage_servers

pytestmark = pytest.mark.slow

SEEN: list[dict[str, Any]] = []  # every server event of this module, for the GA check at the end
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather at a place, in the given unit",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    },
}
NOOP = {
    "type": "function",
    "name": "noop",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
SCHEMAS = {"get_weather": WEATHER["parameters"], "noop": NOOP["parameters"]}


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStages]:
    with stage_servers(tiny_ckpt, tmp_path_factory.mktemp("realtime_tools_logs")) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_url(stages: RunningStages) -> Iterator[str]:
    with realtime_gateway(stages.addrs, seed=0, max_response_units=3) as url:
        yield url


@pytest.fixture()
def conn(gateway_url: str) -> Iterator[Conn]:
    with closing_session(f"{gateway_url}/v1/realtime", seen=SEEN) as c:
        yield c


def _open(conn: Conn, **extra: Any) -> dict[str, Any]:
    """A GA-shaped session (24 kHz PCM input) with a reference voice, spoken output by default."""
    session: dict[str, Any] = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
        "ref_audio": wav_data_uri(tone(1.0, freq=180.0)),
        "turn_detection": None,
    }
    session.update(extra)
    conn.send({"type": "session.update", "session": session})
    conn.until("session.created", 60)
    return conn.until("session.updated", 60)


def _commit(conn: Conn, seconds: float = 1.2) -> None:
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(seconds, rate=24000))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.until("conversation.item.done", 60)


def _only_call(done: dict[str, Any]) -> dict[str, Any]:
    """The function call of a response that made nothing else, its arguments checked against the schema."""
    response = done["response"]
    assert response["status"] == "completed" and response["status_details"] is None, response
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["status"] == "completed", call
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return call


def _no_errors(conn: Conn) -> None:
    errors = [e for e in conn.events if e["type"] == "error"]
    assert not errors, errors


def test_turn_lane_forced_call_and_its_result(conn: Conn) -> None:
    """``required`` in the session: the answer to a committed turn is one schema-valid call and nothing
    else (no message, no audio). A bad ``call_id`` is refused by name and the session goes on; the right
    result plus ``response.create`` (no new audio needed) gives a normal spoken answer. A named function
    per response picks that function."""
    updated = _open(conn, tools=[WEATHER, NOOP], tool_choice="required")
    assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "noop"]
    _commit(conn)
    conn.send({"type": "response.create"})
    rid = conn.until("response.created", 60)["response_id"]
    done = conn.until("response.done", 300)
    assert done["response_id"] == rid
    call = _only_call(done)
    mine = [e for e in conn.events if e.get("response_id") == rid]
    assert not any(e["type"].startswith("response.output_audio") for e in mine)
    deltas = [e for e in mine if e["type"] == "response.function_call_arguments.delta"]
    assert deltas and all(d["call_id"] == call["call_id"] and d["item_id"] == call["id"] for d in deltas)

    conn.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "call_0", "output": "x"},
        }
    )
    err = conn.until("error", 60)
    assert err["error"]["param"] == "item.call_id" and err["error"]["code"] == "invalid_value"
    conn.events.remove(err)
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": json.dumps({"temp": 21})}
    conn.send({"type": "conversation.item.create", "item": result})
    item = conn.until("conversation.item.done", 60)["item"]
    assert item["type"] == "function_call_output" and item["call_id"] == call["call_id"]
    conn.send({"type": "response.create", "response": {"tool_choice": "none", "max_output_tokens": 4}})
    answer_id = conn.until("response.created", 60)["response_id"]
    answer = conn.until("response.done", 300)
    assert answer["response_id"] == answer_id and answer["response"]["status"] in ("completed", "incomplete")
    (message,) = answer["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["type"] == "output_audio"
    assert any(
        e["type"] == "response.output_audio.delta" and e["response_id"] == answer_id for e in conn.events
    )

    _commit(conn)
    conn.send({"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "noop"}}})
    named = _only_call(conn.until("response.done", 300))
    assert named["name"] == "noop" and json.loads(named["arguments"]) == {}
    conn.until("rate_limits.updated", 30)
    _no_errors(conn)
    summary = check_response_invariants(conn.events)
    assert [len(s["calls"]) for s in summary.values()] == [1, 0, 1]


def test_native_lane_call_then_the_model_keeps_listening(conn: Conn) -> None:
    """Native lane (the model decides per unit): ``response.create`` with a named function makes the next
    model turn that call; the session keeps feeding the model every unit the client sends while the call
    is outstanding (each is decided: listen, or a turn of the model's own); the result goes in before the
    next unit, and ``response.create`` then starts the model's answer."""
    _open(
        conn,
        output_modalities=["text"],
        tools=[WEATHER],
        max_response_output_tokens=2,
        extra_body={"auto_response": True, "force_listen_count": 2},
    )
    _commit(conn)  # two units, forced to listen
    for _ in range(2):
        assert conn.until("response.listen", 60)["response"]["metadata"]["reason"] == "model_listen"
    conn.send(
        {"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "get_weather"}}}
    )
    rid = conn.until("response.created", 60)["response_id"]
    done = conn.until("response.done", 300)
    assert done["response_id"] == rid
    call = _only_call(done)
    assert call["name"] == "get_weather"

    # The client keeps talking; every unit reaches the model and is decided while the call is outstanding.
    decided_before = _decided(conn)
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(2.0, rate=24000))})
    deadline = time.time() + 300
    while _decided(conn) < decided_before + 2:
        assert time.time() < deadline, [e["type"] for e in conn.events[-20:]]
        conn.recv(max(0.1, deadline - time.time()))
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}
    conn.send({"type": "conversation.item.create", "item": result})
    conn.until("conversation.item.done", 60)
    answer = _create_when_idle(
        conn, {"tool_choice": "none", "output_modalities": ["text"], "max_output_tokens": 2}
    )
    (message,) = answer["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["type"] == "output_text"
    conn.until("rate_limits.updated", 30)
    _no_errors(conn)
    check_response_invariants(conn.events)


def _decided(conn: Conn) -> int:
    """Units the native session has reported a decision on: listens, and units of model responses."""
    listens = sum(1 for e in conn.events if e["type"] == "response.listen")
    spoken = sum(1 for e in conn.events if e["type"] == "response.created")
    return listens + spoken


def _create_when_idle(conn: Conn, options: dict[str, Any]) -> dict[str, Any]:
    """``response.create`` once no model-initiated response is running (the native model may have taken the
    floor on its own); returns that response's ``response.done``."""
    deadline = time.time() + 300
    while True:
        conn.send({"type": "response.create", "response": options})
        while True:
            event = conn.recv(max(0.1, deadline - time.time()))
            if event["type"] == "error" and event["error"]["code"] == "response_already_active":
                conn.events.remove(event)
                conn.until("response.done", 300)
                break
            if event["type"] == "response.created":
                rid = event["response_id"]
                done = conn.until("response.done", 300)
                while done["response_id"] != rid:
                    done = conn.until("response.done", 300)
                return done
            assert time.time() < deadline


def test_stock_openai_sdk_parses_the_call_events(gateway_url: str) -> None:
    """The official ``openai`` SDK's realtime connection, unmodified: a forced call, its result sent with the
    SDK's own ``conversation.item.create``, the answer; every event through the SDK's models with warnings
    as errors."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        api_key="unused",
        base_url=gateway_url.replace("ws://", "http://") + "/v1",
        websocket_base_url=gateway_url + "/v1",
    )
    session = {
        "type": "realtime",
        "output_modalities": ["text"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
        "tools": [WEATHER],
        "tool_choice": "required",
    }
    seen: list[Any] = []
    dones: list[Any] = []
    with client.realtime.connect(model="openbmb/MiniCPM-o-4_5", extra_query={"autostart": "0"}) as rt:
        rt.send({"type": "session.update", "session": session})
        deadline = time.time() + 300
        for event in rt:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                event.model_dump()
                event.to_json()
            seen.append(event)
            if event.type == "session.updated" and sum(e.type == "session.updated" for e in seen) == 1:
                rt.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.2, rate=24000))})
                rt.send({"type": "input_audio_buffer.commit"})
                rt.response.create()
            if event.type == "response.done":
                dones.append(event)
                if len(dones) == 1:
                    call = event.response.output[0]
                    rt.conversation.item.create(
                        item={
                            "type": "function_call_output",
                            "call_id": call.call_id,
                            "output": '{"temp": 21}',
                        }
                    )
                    rt.response.create(response={"tool_choice": "none", "max_output_tokens": 3})
            if len(dones) == 2 or event.type == "error" or time.time() > deadline:
                break
    types = [e.type for e in seen]
    assert "error" not in types, [e for e in seen if e.type == "error"]
    call = dones[0].response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    args_done = next(e for e in seen if e.type == "response.function_call_arguments.done")
    assert (
        args_done.call_id == call.call_id
        and args_done.arguments == call.arguments
        and args_done.name == call.name
    )
    assert "conversation.item.done" in types and dones[1].response.output[0].type == "message"
    SEEN.extend(e.model_dump(mode="json", exclude_unset=True) for e in seen)


def test_every_event_fits_the_sdk_ga_models() -> None:
    """Every server event of the sessions above validates against the stock ``openai`` SDK's GA model for
    its type (``model_validate``), with no extra key beyond the dialect's documented ones."""
    pytest.importorskip("openai")
    assert SEEN, "run with the tests above"
    checked = {e["type"] for e in SEEN if ga_model(e["type"]) is not None}
    for needed in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.added",
        "conversation.item.done",
        "response.done",
        "session.updated",
    ):
        assert needed in checked, needed
    problems = sorted({p for e in SEEN for p in ga_problems(e)})
    assert not problems, "\n".join(problems)
