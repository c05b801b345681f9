"""Native-lane turns the model owns, through the REAL stages (docs/protocol.md, Invariants B1 follow-up,
R1–R12).

With the random weights of the tiny checkpoint the thinker practically never ends a turn: it would have
to pick ``<|turn_eos|>``, one token among ~150 000. This module therefore runs the real stages on a copy
of the ``tiny_ckpt`` checkpoint whose ``lm_head`` row for ``<|turn_eos|>`` is scaled up (×4), so the
logit of that token has four times the spread of the others and the greedy decoder ends a turn at a
handful of positions per unit. Which units speak, where each turn ends and when the model starts its
next turn is still decided by real forward passes over the user's audio; the test only states what the
gateway must make of it: the model's turns become back-to-back responses (the next turn's decision and
early audio wait for the previous ``response.done``), and user audio streamed over the assistant never
produces an error, a cancellation, a barge-in or an epoch change (B1).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from realtime_helpers import pcm16_b64, response_metadata, session_body, tone
from realtime_invariants import check_response_invariants
from realtime_stages import Conn, realtime_gateway, stage_servers

from services.common.checkpoint import SPECIAL_TOKEN_IDS

pytestmark = pytest.mark.slow

TURN_EOS_GAIN = 4.0


def _turn_ending_copy(src: Path, dst: Path) -> Path:
    """``src`` with the ``<|turn_eos|>`` row of the thinker's ``lm_head`` multiplied by TURN_EOS_GAIN."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["llm.lm_head.weight"]
    tensors = load_file(str(shard))
    tensors["llm.lm_head.weight"][SPECIAL_TOKEN_IDS["<|turn_eos|>"]] *= TURN_EOS_GAIN
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def gateway_url(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ckpt = _turn_ending_copy(tiny_ckpt, tmp_path_factory.mktemp("turn_ending") / "ckpt")
    with stage_servers(ckpt, tmp_path_factory.mktemp("native_stage_logs")) as stages:
        with realtime_gateway(stages.addrs, seed=0) as url:
            yield url


def test_b1_user_talks_over_model_owned_back_to_back_turns(gateway_url: str) -> None:
    """B1 with a model-owned follow-up: native lane, ``overlap_policy: listen_only``, greedy decoding.

    The user's first second of audio makes the model speak (checked, not assumed); five more seconds of
    user audio then stream in while it speaks. The model ends its turn and takes the floor again on its
    own, so several responses follow each other. Asserted: no ``error``, no cancelled ``response.done``,
    no ``overlap.decision`` (so no barge-in), every epoch-carrying event at epoch 0 and no stage
    interrupt; every follow-up response has a fresh id and is created after the previous response's
    ``response.done``; R1–R12 hold for every finished response.
    """
    conn = Conn(f"{gateway_url}/v1/duplex")
    try:
        conn.send(
            {
                "type": "session.update",
                "session": session_body(temperature=0.0, extra_body={"auto_response": True}),
            }
        )
        conn.until("session.updated", 60)
        conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        while (first := conn.recv(300))["type"] not in ("response.created", "response.listen"):
            pass
        assert first["type"] == "response.created", "the model listened to the first unit; it should speak"
        for k in range(5):  # the user keeps talking over the assistant
            conn.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": pcm16_b64(tone(1.0, freq=220.0 + 20 * (k + 1))),
                }
            )
        end = time.time() + 300
        while time.time() < end and sum(e["type"] == "response.done" for e in conn.events) < 3:
            conn.recv(max(0.1, end - time.time()))
        conn.send({"type": "session.heartbeat"})
        conn.until("session.heartbeat_ack", 60)
        time.sleep(1.5)
        conn.send({"type": "session.close"})
        conn.until("session.closed", 60)
    finally:
        with contextlib.suppress(Exception):
            conn.close()

    events = conn.events
    dones = [e for e in events if e["type"] == "response.done"]
    assert len(dones) >= 3, f"the model took {len(dones)} finished turns; expected follow-ups"
    assert not [e for e in events if e["type"] in ("error", "overlap.decision", "duplex.stage_interrupt_ack")]
    assert all(d["response"]["status"] == "completed" for d in dones)
    epochs = [e["metadata"]["epoch"] for e in events if e["type"] == "response.output_audio.delta"]
    epochs += [e["epoch"] for e in events if e["type"] == "response.listen"]
    epochs += [response_metadata(e)["epoch"] for e in events if e["type"] == "response.created"]
    epochs += [response_metadata(d)["epoch"] for d in dones]
    assert set(epochs) == {0}

    created = [i for i, e in enumerate(events) if e["type"] == "response.created"]
    done_at = {e["response_id"]: i for i, e in enumerate(events) if e["type"] == "response.done"}
    ids = [events[i]["response_id"] for i in created]
    assert len(set(ids)) == len(ids)  # fresh ids
    for k in range(1, len(created)):  # each follow-up starts after the previous response's done
        assert done_at[ids[k - 1]] < created[k]
    # Back to back: the model's next turn was decided while the previous response was still sending its
    # audio, so its response opens right behind the previous one's terminal events.
    adjacent = [k for k in range(1, len(created)) if created[k] == done_at[ids[k - 1]] + 2]
    print(f"native turns: {len(ids)} responses, {len(adjacent)} opened right after the previous done")
    assert adjacent, [events[i]["type"] for i in range(created[0], len(events))][:200]
    # The session was closed mid-turn at most once (the last response); every finished one obeys R1–R12.
    assert all(rid in done_at for rid in ids[:-1])
    unfinished = set(ids) - set(done_at)
    finished = [
        e
        for e in events
        if not (
            e.get("response_id") in unfinished
            or e.get("item", {}).get("id", "")[len("item_") :] in unfinished
        )
    ]
    summary = check_response_invariants(finished)
    assert len(summary) == len(done_at)
    assert all(info["audio_bytes"] > 0 for info in summary.values())
