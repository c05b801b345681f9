"""An audio delta leaves as soon as its audio reaches the gateway, less a 20 ms tail kept for the turn's
``end_of_turn`` delta (the gateway once held a whole chunk until the next one arrived, which delayed the
first audio by code2wav's next window: ~190 ms on the H200).

No stage runs: a scripted pipeline answers the requesting unit with a speak decision and one 1 s chunk
of audio, and ends the turn only when the test says so, after the first delta has arrived.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gateway_server import serve_in_thread
from realtime_helpers import QuietPipeline, pcm16_b64, session_body, tone
from websockets.sync.client import ClientConnection, connect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.lifecycle import HELD_TAIL_SAMPLES
from gateway.realtime.pipeline.events import AudioOut, UnitOutcome, UnitRole
from gateway.realtime.session import DuplexSession

CHUNK = 24_000  # one unit of 24 kHz audio


class OneChunkPipeline(QuietPipeline):
    """Speaks one chunk at the requesting unit; :meth:`end_turn` (from another thread) ends the turn."""

    def __init__(self, session: DuplexSession) -> None:
        self.session = session
        self.loop = asyncio.get_running_loop()
        self.epoch = 0

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None:
        if role is UnitRole.REQUEST:
            self.epoch = epoch
            self.session.post_pipeline(UnitOutcome(epoch, unit_seq, "speak", "hello", False, 20, 1))
            audio = np.linspace(-0.5, 0.5, CHUNK, dtype=np.float32)
            self.session.post_pipeline(AudioOut(epoch, audio, False, 1))

    def end_turn(self) -> None:
        last = AudioOut(self.epoch, np.zeros(0, dtype=np.float32), True, 1)
        self.loop.call_soon_threadsafe(self.session.post_pipeline, last)


@pytest.fixture()
def gateway() -> Iterator[tuple[str, list[OneChunkPipeline]]]:
    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    pipelines: list[OneChunkPipeline] = []

    def factory(session: DuplexSession) -> OneChunkPipeline:
        pipelines.append(OneChunkPipeline(session))
        return pipelines[-1]

    app.state.realtime_pipeline_factory = factory
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime", pipelines


def _next(ws: ClientConnection, types: set[str], timeout: float = 5.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        event = json.loads(ws.recv(timeout=max(0.01, end - time.monotonic())))
        assert event["type"] != "error", event
        if event["type"] in types:
            return event


def _samples(delta: dict[str, Any]) -> int:
    return len(base64.b64decode(delta["delta"])) // 2


def test_first_delta_goes_out_before_the_turn_has_more_audio(gateway) -> None:  # noqa: ANN001
    url, pipelines = gateway
    with connect(url, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.update", "session": session_body()}))
        _next(ws, {"session.updated"})
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit", "response_create": True}))
        # Only one chunk exists so far: its delta must arrive without waiting for more audio.
        first = _next(ws, {"response.output_audio.delta"})
        assert _samples(first) == CHUNK - HELD_TAIL_SAMPLES
        assert first["metadata"]["end_of_turn"] is False
        pipelines[0].end_turn()
        last = _next(ws, {"response.output_audio.delta", "response.done"})
        assert last["type"] == "response.output_audio.delta"
        assert _samples(last) == HELD_TAIL_SAMPLES and last["metadata"]["end_of_turn"] is True
        done = _next(ws, {"response.done"})
        assert done["response"]["status"] == "completed"
