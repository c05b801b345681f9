"""The demo client (examples/realtime_duplex_demo.py) against a scripted server: how a session ends.

No gateway or stage runs here. A small websockets server plays the gateway's part of the protocol so the
test can place frames exactly where a loaded machine puts them by chance: the server closes the socket
right after ``session.closed`` (docs/protocol.md, Realtime session end), so a client may still hold unread
events, the
``session.closed`` and the close frame all in one receive buffer. The demo client once died there: its
reader acked an event, the ack met the closing socket and raised, and the client waited ``--timeout``
for a ``session.closed`` that sat unread (CI: ``close_timeout: true, session_closed: false``).
"""

from __future__ import annotations

import asyncio
import json
import time
import wave
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from realtime_helpers import pcm16_b64, tone
from websockets.asyncio.server import ServerConnection, serve

from examples.realtime_duplex_demo import build_parser, run

TIMEOUT_S = 20.0  # the client's --timeout; every case must end well before it


class ScriptedGateway:
    """Just enough of the gateway for one turn-lane exchange; ``on_close`` decides how the session ends."""

    def __init__(self, on_close: Callable[[ScriptedGateway, ServerConnection], Awaitable[None]]) -> None:
        self.on_close = on_close
        self.seq = 0

    def frame(self, type_: str, **fields: Any) -> str:
        self.seq += 1
        return json.dumps(
            {"type": type_, "event_id": f"event_{self.seq:032x}", "server_event_seq": self.seq, **fields}
        )

    async def handler(self, conn: ServerConnection) -> None:
        await conn.recv()  # session.update
        await conn.send(
            json.dumps(
                {
                    "type": "session.created",
                    "event_id": "event_" + "0" * 32,
                    "session": {"id": "duplex-" + "0" * 32},
                }
            )
        )
        async for raw in conn:
            kind = json.loads(raw)["type"]
            if kind == "input_audio_buffer.commit":
                await self._respond(conn)
            elif kind == "session.close":
                await self.on_close(self, conn)
                return

    async def _respond(self, conn: ServerConnection) -> None:
        rid = "resp_" + "1" * 24
        await conn.send(self.frame("input_audio_buffer.committed", item_id="item_u", event={"turn_id": 1}))
        await conn.send(
            self.frame("response.created", response_id=rid, response={"id": rid, "status": "in_progress"})
        )
        await conn.send(
            self.frame(
                "response.output_audio.delta",
                response_id=rid,
                delta=pcm16_b64(tone(0.5)),
                metadata={"audio_duration_ms": 500},
            )
        )
        await conn.send(self.frame("response.output_audio_transcript.delta", response_id=rid, delta=""))
        await conn.send(
            self.frame("response.done", response_id=rid, response={"id": rid, "status": "completed"})
        )
        await conn.send(self.frame("rate_limits.updated", rate_limits=[]))


def _in_one_write(
    conn: ServerConnection, *texts: str, close_code: int | None = None, reason: str = ""
) -> None:
    """Queue text frames (and a close frame) and hand them to the socket as ONE write, so the client
    receives them in one read, as a busy client does after a scheduling delay."""
    for text in texts:
        conn.protocol.send_text(text.encode())
    if close_code is not None:
        conn.protocol.send_close(close_code, reason)
    conn.transport.write(b"".join(conn.protocol.data_to_send()))


async def _closed_after_an_ackable_event(gw: ScriptedGateway, conn: ServerConnection) -> None:
    acked = gw.frame("playback.acknowledged", event={"played_ms": 500})
    closed = gw.frame("session.closed", session_id="duplex-" + "0" * 32, reason="client_close")
    _in_one_write(conn, acked, closed, close_code=1000)
    await conn.wait_closed()


async def _dropped_without_session_closed(gw: ScriptedGateway, conn: ServerConnection) -> None:
    _in_one_write(
        conn, gw.frame("playback.acknowledged", event={"played_ms": 500}), close_code=1011, reason="boom"
    )
    await conn.wait_closed()


async def _garbage_then_nothing(gw: ScriptedGateway, conn: ServerConnection) -> None:
    await conn.send("this is not JSON")
    await conn.wait_closed()  # the socket stays open until the client ends it


def _demo(
    tmp_path: Path, on_close: Callable[[ScriptedGateway, ServerConnection], Awaitable[None]]
) -> tuple[dict[str, Any], float]:
    wav, ref = tmp_path / "in.wav", tmp_path / "ref.wav"
    for path, x in ((wav, tone(1.2)), (ref, tone(1.0, freq=180.0))):
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())

    async def main() -> tuple[dict[str, Any], float]:
        gateway = ScriptedGateway(on_close)
        async with serve(gateway.handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            args = build_parser().parse_args(
                [
                    "--url",
                    f"ws://127.0.0.1:{port}/v1/realtime",
                    "--input-wav",
                    str(wav),
                    "--ref-audio",
                    str(ref),
                    "--output-dir",
                    str(tmp_path / "out"),
                    "--turn-lane",
                    "--no-realtime",
                    "--timeout",
                    str(TIMEOUT_S),
                ]
            )
            start = time.monotonic()
            result = await run(args)
            return result, time.monotonic() - start

    result, elapsed = asyncio.run(main())
    assert json.loads((tmp_path / "out" / "result.json").read_text())["ok"] == result["ok"]
    return result, elapsed


@pytest.mark.parametrize("repeat", range(3))
def test_session_closed_behind_an_acked_event_is_read(tmp_path: Path, repeat: int) -> None:
    """The regression: an event the client acks, ``session.closed`` and the close frame arrive together."""
    result, elapsed = _demo(tmp_path, _closed_after_an_ackable_event)
    assert result["session_closed"] and not result.get("close_timeout"), result
    assert result["ok"] and "reader_error" not in result and "socket_closed" not in result, result
    assert elapsed < TIMEOUT_S / 2


def test_socket_closed_without_session_closed_is_reported_at_once(tmp_path: Path) -> None:
    result, elapsed = _demo(tmp_path, _dropped_without_session_closed)
    assert not result["ok"] and not result["session_closed"]
    assert result["socket_closed"] == {"code": 1011, "reason": "boom"}, result
    assert not result.get("close_timeout")
    assert elapsed < TIMEOUT_S / 2


def test_reader_failure_is_reported_at_once(tmp_path: Path) -> None:
    result, elapsed = _demo(tmp_path, _garbage_then_nothing)
    assert not result["ok"]
    assert result["reader_error"].startswith("JSONDecodeError"), result
    assert elapsed < TIMEOUT_S / 2
