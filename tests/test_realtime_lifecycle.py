"""Unit tests of the response-lifecycle projection and interrupt handling (wire-protocol §6 R*, B2–B4, B7–B9).

Scope, stated plainly: these tests replace the gRPC stage pipeline with :class:`ScriptedPipeline`, which
plays back scripted thinker decisions and 24 kHz audio into the session mailbox. They check the
gateway's own logic (event order, epochs, the gateway half of the double fence, playback/truncate
bookkeeping) deterministically; they are not end-to-end. The same invariants are checked against real
stage servers in tests/test_realtime_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from realtime_helpers import pcm16_b64, receive_until, session_body, tone
from realtime_invariants import check_response_invariants

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.duplex_pipeline import AudioOut, StageAck, UnitOutcome


class ScriptedPipeline:
    """Speaks ``words`` one per unit (0.5 s of audio each) until ``units_per_turn``, then ends the turn."""

    def __init__(self, session: Any, *, units_per_turn: int = 3, unit_delay_s: float = 0.0,
                 late_audio_after_interrupt: bool = True) -> None:
        self.session = session
        self.units_per_turn = units_per_turn
        self.unit_delay_s = unit_delay_s
        self.late_audio = late_audio_after_interrupt
        self.epoch = 0
        self.spoken = 0
        self.speaking = False
        self.interrupts: list[tuple[int, str]] = []
        self.pushed: list[tuple[int, int, bool]] = []

    def push_unit(self, samples: np.ndarray, frames: list[bytes], unit_seq: int, epoch: int, turn_id: int,
                  request_response: bool) -> None:
        self.pushed.append((unit_seq, epoch, request_response))
        if request_response:
            self.speaking, self.spoken = True, 0
        if not self.speaking:
            return
        self.spoken += 1
        outcome = UnitOutcome(epoch, unit_seq, "speak", f"w{self.spoken} ", self.spoken >= self.units_per_turn, 40)
        audio = AudioOut(epoch, np.full(12_000, 0.1, dtype=np.float32), False)
        loop = asyncio.get_running_loop()
        delay = self.unit_delay_s
        loop.call_later(delay, self.session.post_pipeline, outcome)
        loop.call_later(delay * 1.5, self.session.post_pipeline, audio)

    def allow_speech_from(self, unit_seq: int, first: int) -> None:
        pass

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None:
        self.speaking = False
        last = AudioOut(epoch, np.full(4_800, 0.1, dtype=np.float32), True)
        asyncio.get_running_loop().call_later(self.unit_delay_s * 2, self.session.post_pipeline, last)

    def interrupt(self, new_epoch: int, reason: str) -> None:
        old, self.epoch = self.epoch, new_epoch
        self.interrupts.append((new_epoch, reason))
        self.speaking = False
        for stage in ("thinker", "talker", "code2wav"):
            self.session.post_pipeline(StageAck(stage, new_epoch, 1))
        if self.late_audio:
            # a straggler of the old epoch, as if a stage emitted it before seeing the interrupt
            self.session.post_pipeline(AudioOut(old, np.full(2_400, 0.5, dtype=np.float32), False))

    async def close(self) -> None:
        pass


@pytest.fixture()
def setup() -> Iterator[tuple[TestClient, dict[str, Any]]]:
    app = create_app(GatewayConfig(stage_addrs={"thinker": "127.0.0.1:1", "talker": "127.0.0.1:1", "code2wav": "127.0.0.1:1"}))
    knobs: dict[str, Any] = {"units_per_turn": 3, "unit_delay_s": 0.0, "pipelines": []}

    def factory(session: Any) -> ScriptedPipeline:
        p = ScriptedPipeline(session, units_per_turn=knobs["units_per_turn"], unit_delay_s=knobs["unit_delay_s"])
        knobs["pipelines"].append(p)
        return p

    app.state.realtime_pipeline_factory = factory
    with TestClient(app) as client:
        yield client, knobs


def _open_and_commit(ws: Any, **overrides: Any) -> str:
    """Open a session and commit 1.3 s of speech; returns the user item id."""
    ws.send_json({"type": "session.update", "session": session_body(**overrides)})
    assert ws.receive_json()["type"] == "session.created"
    assert ws.receive_json()["type"] == "session.updated"
    ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.3))})
    ws.send_json({"type": "input_audio_buffer.commit"})
    return receive_until(ws, "conversation.item.done")[-1]["item"]["id"]


def test_turn_lane_response_normative_order(setup: tuple[TestClient, dict[str, Any]]) -> None:
    client, knobs = setup
    with client.websocket_connect("/v1/duplex") as ws:
        _open_and_commit(ws)
        ws.send_json({"type": "response.create"})
        events = receive_until(ws, "rate_limits.updated")
        types = [e["type"] for e in events]
        assert types[:5] == [
            "response.created",
            "conversation.item.added",
            "conversation.item.created",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert "response.speak" not in types  # speak is a native-lane event
        summary = check_response_invariants(events)
        (rid, info), = summary.items()
        assert info["status"] == "completed" and info["transcript"] == "w1 w2 w3 "
        assert info["audio_deltas"] == 4  # three 0.5 s units + the 0.2 s tail
        assert info["audio_bytes"] == 2 * (3 * 12_000 + 4_800)
        # units: the 2 committed (1.3 s -> 1 full + padded residual), request on the last, then silence feeds
        pushed = knobs["pipelines"][0].pushed
        assert [r for _, _, r in pushed[:2]] == [False, True] and len(pushed) == 4
        ws.send_json({"type": "response.create"})
        assert ws.receive_json()["error"]["code"] == "response_create_without_input"


def test_native_lane_speak_and_listen(setup: tuple[TestClient, dict[str, Any]]) -> None:
    client, knobs = setup
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_json({"type": "session.update", "session": session_body(extra_body={"auto_response": True})})
        receive_until(ws, "session.updated")
        pipeline = knobs["pipelines"][0]
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        ws.send_json({"type": "session.heartbeat"})
        receive_until(ws, "session.heartbeat_ack")
        assert pipeline.pushed == [(0, 0, False)]  # forwarded at once, no response requested
        session = next(iter(client.app.state.realtime.registry.sessions.values()))
        session.post_pipeline(UnitOutcome(0, 0, "listen", "", False, 13))
        listen = ws.receive_json()
        assert listen["type"] == "response.listen" and "response_id" not in listen
        session.post_pipeline(UnitOutcome(0, 1, "speak", "hi", True, 30))
        session.post_pipeline(AudioOut(0, np.full(24_000, 0.1, dtype=np.float32), False))
        session.post_pipeline(AudioOut(0, np.zeros(0, dtype=np.float32), True))
        events = receive_until(ws, "rate_limits.updated")
        types = [e["type"] for e in events]
        assert types.index("response.speak") < types.index("response.output_audio.delta")
        summary = check_response_invariants(events)
        (info,) = summary.values()
        assert info["audio_deltas"] == 1 and info["transcript"] == "hi"


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ({"type": "barge_in"}, "barge_in"),
        ({"type": "response.cancel"}, "client_cancelled"),
        ({"type": "output_audio_buffer.clear"}, "output_audio_buffer_clear"),
        ({"type": "input.cancel"}, "barge_in"),
        ({"type": "turn.signal", "event": "barge_in"}, "barge_in"),
    ],
)
def test_hard_interrupts(setup: tuple[TestClient, dict[str, Any]], command: dict[str, Any], reason: str) -> None:
    client, knobs = setup
    knobs["units_per_turn"] = 1000
    knobs["unit_delay_s"] = 0.02
    with client.websocket_connect("/v1/duplex") as ws:
        _open_and_commit(ws)
        ws.send_json({"type": "response.create"})
        events = receive_until(ws, "response.output_audio_transcript.delta")
        events += receive_until(ws, "response.output_audio_transcript.delta")
        ws.send_json(command)
        events += receive_until(ws, "rate_limits.updated")
        # drain: stage acks and anything late, then prove the socket is idle with a heartbeat
        ws.send_json({"type": "session.heartbeat"})
        events += receive_until(ws, "session.heartbeat_ack")
        summary = check_response_invariants(events)
        (rid, info), = summary.items()
        assert info["status"] == "cancelled" and info["reason"] == reason
        md = info["done"]["response"]["metadata"]
        assert md["epoch"] > md["cancelled_epoch"]  # B2
        done_at = info["done_index"]
        assert not any(e["type"] == "response.output_audio.delta" for e in events[done_at:])  # B2: nothing late
        if command["type"] == "output_audio_buffer.clear":
            types = [e["type"] for e in events]
            assert types.index("output_audio_buffer.cleared") < types.index("response.done")  # B3
        acks = [e for e in events if e["type"] == "duplex.stage_interrupt_ack"]
        assert sorted(a["event"]["stage"] for a in acks) == ["code2wav", "talker", "thinker"]
        assert all(a["event"]["epoch"] == 1 for a in acks)
        assert knobs["pipelines"][0].interrupts == [(1, reason)]
        # B4: cancelling the finished response; B3: clear after completion adds no second done
        ws.send_json({"type": "response.cancel", "response_id": rid})
        assert ws.receive_json()["error"]["code"] == "response_not_active"
        ws.send_json({"type": "output_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "output_audio_buffer.cleared"
        # R11/B2: the next response is fresh and carries the new epoch
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        ws.send_json({"type": "input_audio_buffer.commit"})
        receive_until(ws, "conversation.item.done")
        knobs["pipelines"][0].units_per_turn = 1
        ws.send_json({"type": "response.create"})
        more = receive_until(ws, "rate_limits.updated")
        created = more[0]
        assert created["type"] == "response.created" and created["response_id"] != rid
        assert created["response"]["metadata"]["duplex_event"]["epoch"] == 1
        check_response_invariants(events + more)


def test_playback_ack_truncate_and_retrieve(setup: tuple[TestClient, dict[str, Any]]) -> None:
    client, knobs = setup
    knobs["units_per_turn"] = 1000
    knobs["unit_delay_s"] = 0.02
    with client.websocket_connect("/v1/duplex") as ws:
        user_item = _open_and_commit(ws)
        ws.send_json({"type": "response.create"})
        events: list[dict[str, Any]] = []

        def until(type_: str) -> dict[str, Any]:
            got = receive_until(ws, type_)
            events.extend(got)  # keep every event: the invariant check needs all deltas
            return got[-1]

        for _ in range(3):
            until("response.output_audio_transcript.delta")
        rid = events[0]["response_id"]
        marks = [e for e in events if e["type"] == "response.output_audio.delta"][-1]["metadata"]["audio_text_marks"]
        # B7: ack echoes, playback monotonic; wrong item -> mismatch
        ws.send_json({"type": "playback.ack", "played_ms": 700, "response_id": rid})
        acked = until("playback.acknowledged")
        assert acked["event"]["played_ms"] == 700 and acked["event"]["committed_ms"] == 700
        assert acked["event"]["playback"]["played_ms"] == 700
        ws.send_json({"type": "playback.ack", "played_ms": 300, "response_id": rid})
        acked = until("playback.acknowledged")
        assert acked["event"]["playback"]["played_ms"] == 700
        ws.send_json({"type": "playback.ack", "played_ms": 10, "item_id": "item_someone_else", "response_id": rid})
        assert until("error")["error"]["code"] == "playback_item_mismatch"
        # B8: barge-in, then the item history is the prefix spoken by committed_ms
        ws.send_json({"type": "barge_in"})
        until("rate_limits.updated")
        ws.send_json({"type": "conversation.item.retrieve", "item_id": "item_" + rid})
        item = until("conversation.item.retrieved")["item"]
        spoken = [m["text_chars"] for m in marks if m["audio_end_ms"] <= 700]
        full = check_response_invariants([e for e in events if e["type"] != "error"])[rid]["transcript"]
        assert item["content"][0]["transcript"] == full[: (spoken[-1] if spoken else 0)]
        assert full.startswith(item["content"][0]["transcript"]) and len(item["content"][0]["transcript"]) < len(full)
        # B9: truncate past the audio, and on a user item
        ws.send_json({"type": "conversation.item.truncate", "item_id": "item_" + rid, "audio_end_ms": 10**7, "content_index": 0})
        assert until("error")["error"]["code"] == "invalid_audio_end_ms"
        ws.send_json({"type": "conversation.item.truncate", "item_id": "item_" + rid, "audio_end_ms": 500, "content_index": 0})
        truncated = until("conversation.item.truncated")
        assert truncated["audio_end_ms"] == 500
        ws.send_json({"type": "conversation.item.truncate", "item_id": user_item, "audio_end_ms": 0})
        assert until("error")["error"]["code"] == "invalid_item_type"


def test_close_during_response_has_no_cancelled_done(setup: tuple[TestClient, dict[str, Any]]) -> None:
    client, knobs = setup
    knobs["units_per_turn"] = 1000
    knobs["unit_delay_s"] = 0.02
    with client.websocket_connect("/v1/duplex") as ws:
        _open_and_commit(ws)
        ws.send_json({"type": "response.create"})
        events = receive_until(ws, "response.output_audio_transcript.delta")
        ws.send_json({"type": "session.close"})
        events += receive_until(ws, "session.closed")
        assert not any(e["type"] == "response.done" for e in events)  # S1 / §4.10
        assert ws.receive()["type"] == "websocket.close"


def test_response_create_while_active_and_deferred_commit(setup: tuple[TestClient, dict[str, Any]]) -> None:
    client, knobs = setup
    knobs["units_per_turn"] = 4
    knobs["unit_delay_s"] = 0.05
    with client.websocket_connect("/v1/duplex") as ws:
        _open_and_commit(ws)
        ws.send_json({"type": "response.create"})
        events = receive_until(ws, "response.created")
        ws.send_json({"type": "response.create"})
        events += receive_until(ws, "error")
        assert events[-1]["error"]["code"] == "response_already_active"
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        events += receive_until(ws, "overlap.decision")
        assert events[-1]["action"] == "listen"
        ws.send_json({"type": "input_audio_buffer.commit", "response_create": True})
        events += receive_until(ws, "input_audio_buffer.committed")
        assert events[-1]["event"]["response_create_deferred"] is True
        events += receive_until(ws, "rate_limits.updated")
        events += receive_until(ws, "rate_limits.updated")  # the deferred response
        summary = check_response_invariants([e for e in events if e["type"] != "error"])
        assert len(summary) == 2 and all(v["status"] == "completed" for v in summary.values())


def test_b1_soft_interrupt_is_model_owned(setup: tuple[TestClient, dict[str, Any]]) -> None:
    """Native lane, listen_only: user speech over the assistant is streamed to the model, no overlap
    decision, no epoch change, no cancellation; the model's follow-up gets a fresh response id."""
    client, knobs = setup
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_json({"type": "session.update", "session": session_body(extra_body={"auto_response": True})})
        receive_until(ws, "session.updated")
        session = next(iter(client.app.state.realtime.registry.sessions.values()))
        pipeline = knobs["pipelines"][0]
        session.post_pipeline(UnitOutcome(0, 0, "speak", "one ", False, 30))
        events = receive_until(ws, "response.speak")
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})  # user talks over it
        ws.send_json({"type": "session.heartbeat"})
        events += receive_until(ws, "session.heartbeat_ack")
        assert len(pipeline.pushed) == 1  # the overlapping unit went to the model
        session.post_pipeline(UnitOutcome(0, 1, "speak", "two", True, 30))  # the model ends its turn
        session.post_pipeline(AudioOut(0, np.full(24_000, 0.1, dtype=np.float32), True))
        events += receive_until(ws, "rate_limits.updated")
        session.post_pipeline(UnitOutcome(0, 2, "speak", "again", True, 30))  # and answers the user
        session.post_pipeline(AudioOut(0, np.full(12_000, 0.1, dtype=np.float32), True))
        events += receive_until(ws, "rate_limits.updated")
        summary = check_response_invariants(events)
        assert len(summary) == 2 and all(v["status"] == "completed" for v in summary.values())
        assert not any(e["type"] in ("overlap.decision", "error") for e in events)
        assert session.epoch == 0 and pipeline.interrupts == []


def test_native_back_to_back_turns_get_their_own_responses(setup: tuple[TestClient, dict[str, Any]]) -> None:
    """The model starts its next turn while the previous turn's audio is still arriving: the second turn's
    decision and early audio wait for the first response's done, then form their own response."""
    client, _ = setup
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_json({"type": "session.update", "session": session_body(extra_body={"auto_response": True})})
        receive_until(ws, "session.updated")
        session = next(iter(client.app.state.realtime.registry.sessions.values()))
        half = np.full(12_000, 0.1, dtype=np.float32)
        for event in (
            UnitOutcome(0, 0, "speak", "first", True, 30, speech_turn=1),
            AudioOut(0, half, False, speech_turn=1),
            UnitOutcome(0, 1, "speak", "second", True, 30, speech_turn=2),
            AudioOut(0, half, False, speech_turn=2),  # the next turn's audio, early
            AudioOut(0, np.zeros(0, dtype=np.float32), True, speech_turn=1),
            AudioOut(0, half[:7_200], True, speech_turn=2),
        ):
            session.post_pipeline(event)
        events = receive_until(ws, "rate_limits.updated")
        events += receive_until(ws, "rate_limits.updated")
        summary = check_response_invariants(events)
        first, second = summary.values()
        assert (first["transcript"], first["audio_bytes"]) == ("first", 24_000)
        assert (second["transcript"], second["audio_bytes"]) == ("second", 2 * (12_000 + 7_200))
        assert first["status"] == second["status"] == "completed"
