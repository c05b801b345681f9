"""Realtime function calls as events, with a scripted pipeline (no stage runs): what the gateway makes of a
unit whose thinker result carries a call, and how the client's result goes back to the model.

The pipeline records what the session asks of it (each unit's role, the response options, the function
results handed over before each unit) and answers the requesting unit with a scripted thinker outcome.
Every event is checked against the response invariants and the stock ``openai`` SDK's GA models.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gateway_server import serve_in_thread
from realtime_ga import ga_problems
from realtime_helpers import QuietPipeline, pcm16_b64, tone, wav_data_uri
from realtime_invariants import check_response_invariants
from websockets.sync.client import ClientConnection, connect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.pipeline.events import AudioOut, UnitOutcome, UnitRole
from gateway.realtime.response_options import ResponseOptions
from gateway.realtime.session import DuplexSession

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather at a place",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit":"c"}}\n</tool_call>'


class ScriptedPipeline(QuietPipeline):
    """Answers each requesting unit with the next scripted outcome: ``(transcript, call, audio, extra)``
    (``extra``: more :class:`UnitOutcome` fields)."""

    def __init__(self, session: DuplexSession, script: list[tuple[str, str, bool, dict[str, Any]]]) -> None:
        self.session = session
        self.script = script
        self.log: list[
            tuple[str, Any]
        ] = []  # ("unit", role) / ("options", ResponseOptions) / ("output", text)

    def begin_response(self, options: ResponseOptions) -> None:
        self.log.append(("options", options))

    def add_tool_output(self, output: str) -> None:
        self.log.append(("output", output))

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None:
        self.log.append(("unit", role))
        if role is not UnitRole.REQUEST:
            return
        transcript, call, audio, extra = self.script.pop(0)
        turn = 1 if audio else 0
        self.session.post_pipeline(
            UnitOutcome(
                epoch, unit_seq, "speak", transcript, True, 40, turn, output_tokens=9, tool_call=call, **extra
            )
        )
        if audio:
            self.session.post_pipeline(AudioOut(epoch, np.full(4800, 0.1, dtype=np.float32), True, turn))


@pytest.fixture()
def gateway() -> Iterator[tuple[str, list[ScriptedPipeline]]]:
    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    pipelines: list[ScriptedPipeline] = []
    script = [
        ("", CALL, False, {}),
        ("Let me check.", CALL, True, {}),
        ("It is sunny.", "", True, {}),
        ("", CALL[:58], False, {"tool_call_truncated": True}),
        ("", CALL[:20], False, {"tool_call_truncated": True}),
        ("Hm.", "", True, {"tool_error": "grammar does not compile: x"}),
    ]

    def factory(session: DuplexSession) -> ScriptedPipeline:
        pipelines.append(ScriptedPipeline(session, list(script)))
        return pipelines[-1]

    app.state.realtime_pipeline_factory = factory
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime", pipelines


class Recorder:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    def send(self, event: dict[str, Any]) -> None:
        self.ws.send(json.dumps(event))

    def until(self, type_: str, timeout: float = 10.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            event = json.loads(self.ws.recv(timeout=max(0.01, end - time.monotonic())))
            self.events.append(event)
            if event["type"] == type_:
                return event


def _session(**extra: Any) -> dict[str, Any]:
    """A GA session object (24 kHz PCM input) with a reference voice."""
    return {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
        "ref_audio": wav_data_uri(tone(1.0, freq=180.0)),
        "turn_detection": None,
        **extra,
    }


def _commit(rec: Recorder) -> None:
    rec.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0, rate=24000))})
    rec.send({"type": "input_audio_buffer.commit"})
    rec.until("input_audio_buffer.committed")


def test_calls_their_items_and_the_result_round_trip(gateway) -> None:  # noqa: ANN001
    """A forced call alone (no message item), a call after spoken text (message item first, then the call),
    a bad and a good ``function_call_output``, and the answer that follows it."""
    url, pipelines = gateway
    with connect(url, open_timeout=10) as ws:
        rec = Recorder(ws)
        rec.send({"type": "session.update", "session": _session(tools=[WEATHER], tool_choice="required")})
        updated = rec.until("session.updated")
        assert updated["session"]["tools"] == [WEATHER] and updated["session"]["tool_choice"] == "required"
        _commit(rec)
        rec.send({"type": "response.create"})
        first = rec.until("response.done")["response"]
        assert first["status"] == "completed" and first["status_details"] is None
        (call,) = first["output"]
        assert (
            call["type"] == "function_call"
            and call["name"] == "get_weather"
            and call["status"] == "completed"
        )
        assert json.loads(call["arguments"]) == {"unit": "c"} and call["call_id"].startswith("call_")
        assert first["metadata"]["finish_reason"] == "tool_calls"
        options = [o for kind, o in pipelines[0].log if kind == "options"]
        assert options[0].tools.forced and [t.name for t in options[0].tools.tools] == ["get_weather"]

        # Spoken text, then a call, in one response (tool_choice auto for this response).
        _commit(rec)
        rec.send({"type": "response.create", "response": {"tool_choice": "auto"}})
        second = rec.until("response.done")["response"]
        message, call2 = second["output"]
        assert message["type"] == "message" and message["content"][0]["transcript"] == "Let me check."
        assert call2["type"] == "function_call" and call2["call_id"] != call["call_id"]
        added = [
            e
            for e in rec.events
            if e["type"] == "response.output_item.added" and e["response_id"] == second["id"]
        ]
        assert [(e["output_index"], e["item"]["type"]) for e in added] == [
            (0, "message"),
            (1, "function_call"),
        ]

        # The result: an unknown call_id is refused by name, the session goes on; the right one is taken.
        rec.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": "call_nope", "output": "x"},
            }
        )
        err = rec.until("error")
        assert err["error"]["param"] == "item.call_id" and err["error"]["type"] == "invalid_request_error"
        output = {"type": "function_call_output", "call_id": call2["call_id"], "output": '{"temp": 21}'}
        rec.send({"type": "conversation.item.create", "item": output})
        done_item = rec.until("conversation.item.done")["item"]
        assert done_item["type"] == "function_call_output" and done_item["output"] == '{"temp": 21}'
        rec.send({"type": "conversation.item.create", "item": output})
        assert rec.until("error")["error"]["param"] == "item.call_id"  # answered already
        rec.send({"type": "conversation.item.retrieve", "item_id": done_item["id"]})
        assert rec.until("conversation.item.retrieved")["item"] == done_item

        # response.create needs no new audio after a result; the result rides on the next unit.
        log = pipelines[0].log
        before = len(log)
        rec.send({"type": "response.create", "response": {"tool_choice": "none"}})
        third = rec.until("response.done")["response"]
        (answer,) = third["output"]
        assert answer["type"] == "message" and answer["content"][0]["transcript"] == "It is sunny."
        rest = log[before:]
        assert rest[0][0] == "options" and not rest[0][1].tools.active
        assert rest[1] == ("output", '{"temp": 21}') and rest[2] == ("unit", UnitRole.REQUEST), rest
        rec.until("rate_limits.updated")

        # A call the thinker's per-call cap cut: an incomplete item, an incomplete response.
        _commit(rec)
        rec.send({"type": "response.create"})
        cut = rec.until("response.done")["response"]
        assert cut["status"] == "incomplete" and cut["status_details"]["reason"] == "max_output_tokens"
        (partial,) = cut["output"]
        assert partial["type"] == "function_call" and partial["status"] == "incomplete"
        assert partial["name"] == "get_weather" and partial["arguments"] == '{"unit":"'
        # Cut before its name: nothing to run, the response still ends (with its empty message item).
        _commit(rec)
        rec.send({"type": "response.create"})
        nameless = rec.until("response.done")["response"]
        assert nameless["status"] == "incomplete" and [o["type"] for o in nameless["output"]] == ["message"]
        # A grammar the thinker could not compile: the turn ran without tools, and the client is told.
        _commit(rec)
        rec.send({"type": "response.create"})
        err = rec.until("error")
        assert err["error"]["param"] == "tools" and "did not compile" in err["error"]["message"]
        rec.events.remove(err)
        assert rec.until("response.done")["response"]["output"][0]["type"] == "message"
        rec.until("rate_limits.updated")

    summary = check_response_invariants(rec.events)
    assert [len(s["calls"]) for s in summary.values()] == [1, 1, 0, 1, 0, 0]
    problems = sorted({p for e in rec.events for p in ga_problems(e)})
    assert not problems, "\n".join(problems)
    for needed in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert needed in {e["type"] for e in rec.events}
