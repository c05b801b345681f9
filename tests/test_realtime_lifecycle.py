"""Response lifecycle and interrupt handling through the REAL stages (docs/protocol.md, Invariants R*, B1,
B3, B4, B7–B9).

The gateway runs under uvicorn on loopback in front of real thinker, talker and code2wav processes on the
tiny checkpoint (CPU); every decision, transcript and audio sample below comes from real model code. The
stages start once for the module. Sampling is seeded (``RealtimeSettings.seed = 0``) and the B1 session
decodes greedily, so with the fixed-seed tiny checkpoint each run sees the same model behaviour.

Most responses go through the turn lane (append, commit, ``response.create``), where the thinker must
speak on the requested unit; ``max_response_units`` keeps them short (3 units) unless a test needs a
response that is still speaking when it interrupts it (then 40).

The random-weight model never ends a turn on its own (it would have to pick ``<|turn_eos|>``, about 1 in
150 000 per token), so a model-owned follow-up response and the native lane's back-to-back turns are
tested in tests/test_realtime_native_turns.py, on a checkpoint variant that ends turns.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from realtime_helpers import pcm16_b64, response_metadata, session_body, tone
from realtime_invariants import check_response_invariants
from realtime_stages import STAGES, Conn, RunningStages, closing_session, realtime_gateway, stage_servers
from websockets.exceptions import ConnectionClosedOK

pytestmark = pytest.mark.slow

LONG = {"max_response_units": 40}  # a response that is still speaking when the test interrupts it


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStages]:
    with stage_servers(tiny_ckpt, tmp_path_factory.mktemp("lifecycle_stage_logs")) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_url(stages: RunningStages) -> Iterator[str]:
    with realtime_gateway(stages.addrs, seed=0, max_response_units=3) as url:
        yield url


@pytest.fixture()
def conn(gateway_url: str) -> Iterator[Conn]:
    with closing_session(f"{gateway_url}/v1/duplex") as c:
        yield c


def _open(conn: Conn, **overrides: Any) -> None:
    conn.send({"type": "session.update", "session": session_body(**overrides)})
    conn.until("session.created", 60)
    conn.until("session.updated", 60)


def _commit_speech(conn: Conn, seconds: float = 1.3) -> str:
    """Append and commit ``seconds`` of speech; returns the user item id."""
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(seconds))})
    conn.send({"type": "input_audio_buffer.commit"})
    return conn.until("conversation.item.done", 60)["item"]["id"]


def _settle(conn: Conn) -> None:
    """Let stragglers (stage acks, late audio that the fences must drop) arrive, then prove the socket idle."""
    conn.send({"type": "session.heartbeat"})
    conn.until("session.heartbeat_ack", 60)
    time.sleep(1.5)
    conn.send({"type": "session.heartbeat"})
    conn.until("session.heartbeat_ack", 60)


def _stage_acks(conn: Conn, epoch: int, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Every stage's ``duplex.stage_interrupt_ack`` for ``epoch`` (from the record, then the socket)."""

    def acked() -> dict[str, dict[str, Any]]:
        return {
            e["event"]["stage"]: e["event"]
            for e in conn.events
            if e["type"] == "duplex.stage_interrupt_ack" and e["event"]["epoch"] == epoch
        }

    end = time.time() + timeout
    while len(acked()) < len(STAGES) and time.time() < end:
        conn.recv(max(0.1, end - time.time()))
    return acked()


def _index(conn: Conn, type_: str, rid: str) -> int:
    return next(i for i, e in enumerate(conn.events) if e["type"] == type_ and e.get("response_id") == rid)


def test_turn_lane_response_order_then_finished_response_commands(conn: Conn) -> None:
    """R1–R12 and the normative order of a real turn-lane response; then, on the finished response:
    B4 (``response.cancel`` ⇒ ``response_not_active``) and B3 (``output_audio_buffer.clear`` ⇒ only
    ``output_audio_buffer.cleared``, no second ``response.done``)."""
    _open(conn)
    _commit_speech(conn)
    start = len(conn.events)
    conn.send({"type": "response.create"})
    conn.until("rate_limits.updated")
    types = [e["type"] for e in conn.events[start:]]
    assert types[:5] == [
        "response.created",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.speak" not in types  # speak is a native-lane event
    ((rid, info),) = check_response_invariants(conn.events).items()
    assert info["status"] == "completed" and info["reason"] is None  # GA: status_details null
    assert response_metadata(info["done"])["finish_reason"] == "stop"
    assert info["audio_deltas"] >= 1 and info["audio_bytes"] > 0 and info["epoch"] == 0

    conn.send({"type": "response.cancel", "response_id": rid})
    assert conn.until("error", 30)["error"]["code"] == "response_not_active"  # B4
    before = len(conn.events)
    conn.send({"type": "output_audio_buffer.clear"})
    cleared = conn.until("output_audio_buffer.cleared", 30)
    assert cleared["response_id"] == rid
    conn.send({"type": "response.create"})  # the committed turn was answered already
    assert conn.until("error", 30)["error"]["code"] == "response_create_without_input"
    _settle(conn)
    assert not any(e["type"] in ("response.done", "response.created") for e in conn.events[before:])  # B3
    # the acknowledgement of a clear after completion names the finished response; it is not one of its events
    check_response_invariants(
        [e for e in conn.events if e["type"] not in ("error", "output_audio_buffer.cleared")]
    )


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        ({"type": "response.cancel"}, "client_cancelled"),
        ({"type": "output_audio_buffer.clear"}, "output_audio_buffer_clear"),
    ],
    ids=["response.cancel", "output_audio_buffer.clear"],
)
def test_client_interrupt_of_a_speaking_response(conn: Conn, command: dict[str, Any], reason: str) -> None:
    """B3 while the real pipeline is speaking: the response ends cancelled with the command's reason
    (``output_audio_buffer.cleared`` first for a clear), every stage acks the new epoch, nothing of the
    cancelled response arrives after its ``response.done``; B4 on the cancelled response; after the
    cancel, the next response is fresh and runs at the new epoch."""
    _open(conn, extra_body=LONG)
    _commit_speech(conn)
    conn.send({"type": "response.create"})
    rid = conn.until("response.created")["response_id"]
    conn.until("response.output_audio.delta")
    conn.send(command)
    done = conn.until("response.done", 60)
    assert done["response_id"] == rid
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == reason
    md = response_metadata(done)
    assert (md["epoch"], md["cancelled_epoch"]) == (1, 0)
    if command["type"] == "output_audio_buffer.clear":
        assert _index(conn, "output_audio_buffer.cleared", rid) < _index(conn, "response.done", rid)
    acks = _stage_acks(conn, epoch=1)
    assert set(acks) == set(STAGES), acks
    conn.send({"type": "response.cancel", "response_id": rid})
    assert conn.until("error", 30)["error"]["code"] == "response_not_active"  # B4
    _settle(conn)
    if command["type"] != "response.cancel":
        check_response_invariants([e for e in conn.events if e["type"] != "error"])
        return  # the next response at the new epoch is checked once, after response.cancel

    conn.send({"type": "session.update", "session": {"extra_body": {"max_response_units": 2}}})
    conn.until("session.updated", 60)
    _commit_speech(conn)
    conn.send({"type": "response.create"})
    created = conn.until("response.created")
    assert created["response_id"] != rid
    assert response_metadata(created)["duplex_event"]["epoch"] == 1
    conn.until("rate_limits.updated")
    summary = check_response_invariants([e for e in conn.events if e["type"] != "error"])
    assert summary[rid]["status"] == "cancelled"
    after = summary[created["response_id"]]
    assert after["status"] == "completed" and after["epoch"] == 1 and after["audio_bytes"] > 0


def test_playback_ack_barge_in_history_and_truncate(conn: Conn) -> None:
    """B7 (ack echoes, monotonic playback, item mismatch), B8 (after a barge-in with committed_ms = T the
    item's transcript is the prefix the audio/text marks give at T, strictly shorter than what was sent)
    and B9 (truncate past the audio, or on a user item, is an error)."""
    _open(conn, extra_body=LONG)
    user_item = _commit_speech(conn)
    conn.send({"type": "response.create"})
    rid = conn.until("response.created")["response_id"]
    marks: list[dict[str, int]] = []
    for _ in range(12):  # until the marks say more text came after the first delta's audio
        marks = conn.until("response.output_audio.delta")["metadata"]["audio_text_marks"]
        if marks[-1]["text_chars"] > marks[0]["text_chars"]:
            break
    assert marks[-1]["text_chars"] > marks[0]["text_chars"], marks
    played = marks[0]["audio_end_ms"]  # the first delta has been heard; later text has not

    conn.send({"type": "playback.ack", "response_id": rid, "played_ms": played})
    acked = conn.until("playback.acknowledged", 30)["event"]
    assert (acked["played_ms"], acked["committed_ms"], acked["item_id"]) == (played, played, "item_" + rid)
    assert acked["playback"]["played_ms"] == played and acked["history_committed"] is False
    conn.send({"type": "playback.ack", "response_id": rid, "played_ms": played // 2})
    assert conn.until("playback.acknowledged", 30)["event"]["playback"]["played_ms"] == played  # monotonic
    conn.send({"type": "playback.ack", "response_id": rid, "item_id": "item_someone_else", "played_ms": 10})
    assert conn.until("error", 30)["error"]["code"] == "playback_item_mismatch"

    conn.send({"type": "barge_in"})
    done = conn.until("response.done", 60)
    assert done["response_id"] == rid and done["response"]["status_details"]["reason"] == "barge_in"
    assert response_metadata(done)["committed_ms"] == played
    _settle(conn)
    sent = check_response_invariants([e for e in conn.events if e["type"] != "error"])[rid]["transcript"]
    conn.send({"type": "conversation.item.retrieve", "item_id": "item_" + rid})
    item = conn.until("conversation.item.retrieved", 30)["item"]
    heard = item["content"][0]["transcript"]
    at_played = max(
        (m["text_chars"] for m in item["metadata"]["audio_text_marks"] if m["audio_end_ms"] <= played),
        default=0,
    )
    assert item["metadata"]["audio_text_marks"][: len(marks)] == marks
    assert heard == sent[:at_played] == sent[: marks[0]["text_chars"]]
    assert 0 < len(heard) < len(sent)

    audio_ms = item["metadata"]["audio_ms"]
    conn.send(
        {
            "type": "conversation.item.truncate",
            "item_id": "item_" + rid,
            "audio_end_ms": audio_ms + 1,
            "content_index": 0,
        }
    )
    assert conn.until("error", 30)["error"]["code"] == "invalid_audio_end_ms"
    conn.send(
        {"type": "conversation.item.truncate", "item_id": user_item, "audio_end_ms": 0, "content_index": 0}
    )
    assert conn.until("error", 30)["error"]["code"] == "invalid_item_type"
    conn.send(
        {
            "type": "conversation.item.truncate",
            "item_id": "item_" + rid,
            "audio_end_ms": 0,
            "content_index": 0,
        }
    )
    truncated = conn.until("conversation.item.truncated", 30)
    assert truncated["audio_end_ms"] == 0 and truncated["event"]["transcript"] == ""


def test_close_during_a_speaking_response(conn: Conn, stages: RunningStages) -> None:
    """S1 (docs/protocol.md): closing mid-response ends the session without a cancelled ``response.done``, and
    every stage releases the session's streams and work (its own gauges read 0)."""
    _open(conn, extra_body=LONG)
    _commit_speech(conn)
    conn.send({"type": "response.create"})
    conn.until("response.output_audio.delta")
    conn.send({"type": "session.close"})
    closed = conn.until("session.closed", 60)
    assert closed["reason"] == "client_close"
    assert not any(e["type"] == "response.done" for e in conn.events)
    with pytest.raises(ConnectionClosedOK) as info:
        conn.recv(30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1000
    end = time.time() + 15
    while any((busy := stages.busy()).values()) and time.time() < end:
        time.sleep(0.2)
    assert not any(busy.values()), busy


def test_response_create_while_active_and_back_to_back_turns(conn: Conn) -> None:
    """``response.create`` during a response ⇒ ``response_already_active``; user audio meanwhile ⇒
    ``overlap.decision{action:listen}``; a commit with ``response_create`` is deferred, and its response
    starts right after the first one's ``response.done``: two back-to-back turns, both completed."""
    _open(conn)
    _commit_speech(conn)
    conn.send({"type": "response.create"})
    first = conn.until("response.created")["response_id"]
    conn.send({"type": "response.create"})
    assert conn.until("error", 60)["error"]["code"] == "response_already_active"
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
    decision = conn.until("overlap.decision", 60)
    assert decision["action"] == "listen" and decision["metadata"]["response_id"] == first
    conn.send({"type": "input_audio_buffer.commit", "response_create": True})
    assert conn.until("input_audio_buffer.committed", 60)["event"]["response_create_deferred"] is True
    conn.until("rate_limits.updated")
    second = conn.until("response.created")["response_id"]
    conn.until("rate_limits.updated")
    summary = check_response_invariants([e for e in conn.events if e["type"] != "error"])
    assert list(summary) == [first, second]
    assert all(
        v["status"] == "completed" and v["audio_bytes"] > 0 and v["epoch"] == 0 for v in summary.values()
    )
    assert _index(conn, "response.done", first) < _index(conn, "response.created", second)


def _decisions_seen(http_url: str) -> float:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    match = re.search(r"^minicpmo_realtime_unit_decision_seconds_count (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_b1_soft_interrupt_native_lane(conn: Conn, gateway_url: str) -> None:
    """B1: native lane, ``overlap_policy: listen_only``, the user keeps talking while the assistant speaks.

    The tiny checkpoint, decoding greedily, answers the first second of this tone with ``speak`` (checked
    below, not assumed). Three more seconds of user audio then overlap the speaking response; the test
    waits until the model has decided every one of those units (the gateway's decision counter) and
    asserts the soft-interrupt invariants: no ``error``, no cancelled ``response.done``, no
    ``overlap.decision`` with ``barge_in``, the epoch unchanged on every epoch-carrying event, and the
    response still speaking (the model kept the floor). Any follow-up response must carry a fresh id and
    start after the previous ``response.done``; this checkpoint never ends its turn, so none appears here
    (tests/test_realtime_native_turns.py covers the follow-up).
    """
    http_url = gateway_url.replace("ws://", "http://")
    _open(conn, temperature=0.0, extra_body={"auto_response": True})
    decided_before = _decisions_seen(http_url)
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
    while (first := conn.recv(300))["type"] not in ("response.created", "response.listen"):
        pass
    assert first["type"] == "response.created", "the model listened to the first unit; it should speak"
    rid = first["response_id"]
    assert response_metadata(first)["duplex_event"]["lane"] == "native"
    conn.until("response.speak", 60)
    overlap = np.concatenate([tone(1.0, freq=f) for f in (300.0, 250.0, 200.0)])
    for i in range(0, overlap.size, 16_000):
        conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(overlap[i : i + 16_000])})
    end = time.time() + 240
    while _decisions_seen(http_url) < decided_before + 4 and time.time() < end:
        try:
            conn.recv(1.0)
        except TimeoutError:
            pass
    assert _decisions_seen(http_url) >= decided_before + 4, "the model did not decide the overlapping units"
    conn.until("response.output_audio.delta")  # at least one more audio delta after the overlap
    _settle(conn)

    events = conn.events
    assert not [e for e in events if e["type"] == "error"]
    assert not [e for e in events if e["type"] == "overlap.decision"]  # in particular no barge_in
    dones = [e for e in events if e["type"] == "response.done"]
    assert all(d["response"]["status"] != "cancelled" for d in dones)
    assert not any(d["response_id"] == rid for d in dones), "the model's response should still be speaking"
    epochs = [e["metadata"]["epoch"] for e in events if e["type"] == "response.output_audio.delta"]
    epochs += [e["epoch"] for e in events if e["type"] in ("response.listen", "overlap.decision")]
    epochs += [response_metadata(e)["epoch"] for e in events if e["type"] == "response.created"]
    assert epochs and set(epochs) == {0}
    assert not [e for e in events if e["type"] == "duplex.stage_interrupt_ack"]
    created = [i for i, e in enumerate(events) if e["type"] == "response.created"]
    done_at = [i for i, e in enumerate(events) if e["type"] == "response.done"]
    assert len({events[i]["response_id"] for i in created}) == len(created)  # fresh ids
    for k in range(1, len(created)):  # a follow-up starts after the previous response's done
        assert any(created[k - 1] < d < created[k] for d in done_at)
    conn.send({"type": "session.close"})
    conn.until("session.closed", 60)


def test_text_only_response_on_an_audio_session(conn: Conn) -> None:
    """``response.create`` with ``output_modalities: ["text"]``: text events only, then a completed
    response whose ``status_details`` is null (OpenAI's GA types)."""
    _open(conn)
    _commit_speech(conn)
    start = len(conn.events)
    conn.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
    done = conn.until("response.done", 120)
    types = [e["type"] for e in conn.events[start:]]
    assert done["response"]["modalities"] == ["text"]
    assert "response.output_text.delta" in types or "response.output_text.done" in types
    assert not any(t.startswith("response.output_audio") for t in types)
    if done["response"]["status"] == "completed":
        assert done["response"]["status_details"] is None
    conn.send({"type": "response.create", "event_id": "bad", "response": {"output_modalities": ["video"]}})
    err = conn.until("error", 30)
    assert err["error"]["code"] == "invalid_value" and err["error"]["param"] == "response.output_modalities"
