"""Per-response options of ``response.create`` on both lanes, through the REAL stages (docs/realtime.md,
Per-response options), and every server event of these sessions checked against the stock ``openai``
SDK's GA models (``tests/realtime_ga.py``).

The gateway runs under uvicorn on loopback in front of real thinker, talker and code2wav processes on the
tiny checkpoint (CPU), seeded. The random-weight model speaks whenever a unit asks for an answer, so a
``max_output_tokens`` budget is what ends its turn (it never picks ``<|turn_eos|>`` by itself), and a
text-only response must open no talker or code2wav stream (the stages' own ``requests_total``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from realtime_ga import ga_model, ga_problems
from realtime_helpers import pcm16_b64, response_metadata, tone, wav_data_uri
from realtime_invariants import check_response_invariants
from realtime_stages import Conn, RunningStages, closing_session, realtime_gateway, stage_servers

pytestmark = pytest.mark.slow

SEEN: list[dict[str, Any]] = []  # every server event of this module, for the GA check at the end


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStages]:
    with stage_servers(tiny_ckpt, tmp_path_factory.mktemp("response_options_logs")) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_url(stages: RunningStages) -> Iterator[str]:
    with realtime_gateway(stages.addrs, seed=0, max_response_units=3) as url:
        yield url


@pytest.fixture()
def conn(gateway_url: str) -> Iterator[Conn]:
    with closing_session(f"{gateway_url}/v1/realtime", seen=SEEN) as c:
        yield c


def _open(conn: Conn, **extra: Any) -> None:
    """A GA-shaped session (24 kHz PCM input) with a reference voice, audio + text by default."""
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
    conn.until("session.updated", 60)


def _commit(conn: Conn, seconds: float = 1.2) -> None:
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(seconds, rate=24000))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.until("conversation.item.done", 60)


def _requests(stages: RunningStages, stage: str) -> float:
    text = httpx.get(stages.metrics_urls[stage], timeout=10).text
    pattern = r"^minicpmo_stage_requests_total\{stage=\"" + stage + r"\"\}\s+(\S+)"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0  # a labelled counter appears with its first stream


def _rid_of(event: dict[str, Any]) -> str | None:
    return event.get("response_id") or (event.get("response") or {}).get("id")


def _response(conn: Conn, rid: str) -> list[dict[str, Any]]:
    return [e for e in conn.events if _rid_of(e) == rid]


def test_text_only_response_in_an_audio_session_turn_lane(conn: Conn, stages: RunningStages) -> None:
    """``output_modalities:["text"]`` on one response: text deltas only, no talker/code2wav stream; the next
    response without options speaks again (the choice was this response's)."""
    _open(conn)
    _commit(conn)
    talker, code2wav = _requests(stages, "talker"), _requests(stages, "code2wav")
    assert talker >= 0 and code2wav >= 0
    conn.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
    created = conn.until("response.created", 60)
    rid = created["response_id"]
    assert created["response"]["output_modalities"] == ["text"]
    done = conn.until("response.done", 300)
    assert done["response"]["status"] == "completed" and done["response"]["status_details"] is None
    assert response_metadata(done)["finish_reason"] == "stop"
    types = [e["type"] for e in _response(conn, rid)]
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    assert not any(t.startswith("response.output_audio") for t in types), types
    text_done = next(e for e in conn.events if e["type"] == "response.output_text.done")
    deltas = "".join(e["delta"] for e in conn.events if e["type"] == "response.output_text.delta")
    assert text_done["text"] == deltas and deltas
    assert done["response"]["output"][0]["content"][0]["type"] == "output_text"
    assert (_requests(stages, "talker"), _requests(stages, "code2wav")) == (talker, code2wav)

    _commit(conn)
    conn.send({"type": "response.create"})
    rid2 = conn.until("response.created", 60)["response_id"]
    conn.until("response.done", 300)
    assert any(e["type"] == "response.output_audio.delta" for e in _response(conn, rid2))
    assert _requests(stages, "talker") > talker, (talker, _requests(stages, "talker"))
    conn.until("rate_limits.updated", 30)
    summary = check_response_invariants(conn.events)
    assert summary[rid]["audio_bytes"] == 0 and summary[rid]["transcript"] == deltas
    assert summary[rid2]["audio_bytes"] > 0


def test_max_output_tokens_ends_the_turn_incomplete(conn: Conn) -> None:
    """A spoken response capped at 3 tokens: the thinker ends the model's turn there, the talker voices
    those tokens, ``response.done`` is ``incomplete`` with GA's ``max_output_tokens`` reason."""
    _open(conn, extra_body={"max_response_units": 40})
    _commit(conn)
    conn.send(
        {
            "type": "response.create",
            "response": {"max_output_tokens": 3, "instructions": "Answer in three words."},
        }
    )
    rid = conn.until("response.created", 60)["response_id"]
    done = conn.until("response.done", 300)
    assert done["response_id"] == rid
    assert done["response"]["status"] == "incomplete"
    assert done["response"]["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    events = _response(conn, rid)
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert audio and audio[-1]["metadata"]["end_of_turn"] is True
    transcript = done["response"]["output"][0]["content"][0]["transcript"]
    assert transcript == "".join(
        e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
    )
    # Three tokens of the tiny vocabulary: short (a unit without a budget speaks up to 18).
    assert 0 < len(transcript) <= 3 * 16
    conn.until("rate_limits.updated", 30)
    assert check_response_invariants(conn.events)[rid]["status"] == "incomplete"


def test_native_lane_response_create_with_options(conn: Conn, stages: RunningStages) -> None:
    """Native lane (the model owns turn taking): ``response.create`` with text-only output, instructions
    and a token budget starts the model's next turn at once, with those options."""
    _open(conn, extra_body={"auto_response": True, "force_listen_count": 2})
    _commit(conn)  # the first units are forced to listen: the model does not answer on its own
    talker = _requests(stages, "talker")
    conn.send(
        {
            "type": "response.create",
            "response": {"output_modalities": ["text"], "instructions": "Be brief.", "max_output_tokens": 2},
        }
    )
    created = conn.until("response.created", 60)
    rid = created["response_id"]
    done = conn.until("response.done", 300)
    assert done["response_id"] == rid
    assert done["response"]["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    types = [e["type"] for e in _response(conn, rid)]
    assert "response.output_text.done" in types
    assert not any(t.startswith("response.output_audio") for t in types)
    assert _requests(stages, "talker") == talker
    assert not any(e["type"] == "error" for e in conn.events), [
        e for e in conn.events if e["type"] == "error"
    ]


def test_cancelled_and_refused_events(conn: Conn) -> None:
    """A cancelled response and a refused option, for the GA check below."""
    _open(conn, extra_body={"max_response_units": 40})
    _commit(conn)
    conn.send({"type": "response.create", "response": {"voice": "alloy"}})
    err = conn.until("error", 60)
    assert err["error"]["code"] == "unsupported_native_response_options"
    assert err["error"]["param"] == "response.voice"
    conn.send({"type": "response.create"})
    rid = conn.until("response.created", 60)["response_id"]
    conn.until("response.output_audio.delta", 300)
    conn.send({"type": "response.cancel", "response_id": rid})
    done = conn.until("response.done", 60)
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}


def test_every_event_fits_the_sdk_ga_models() -> None:
    """Every server event the sessions above received validates against the stock ``openai`` SDK's GA
    model for its type (``model_validate``), with no extra key beyond the dialect's documented ones."""
    pytest.importorskip("openai")
    assert SEEN, "run with the tests above"
    checked = {e["type"] for e in SEEN if ga_model(e["type"]) is not None}
    for needed in (
        "session.created",
        "session.updated",
        "response.created",
        "response.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "conversation.item.done",
        "error",
    ):
        assert needed in checked, needed
    problems = sorted({p for e in SEEN for p in ga_problems(e)})
    assert not problems, "\n".join(problems)
