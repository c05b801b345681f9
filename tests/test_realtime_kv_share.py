"""A realtime session the thinker's KV pool cannot hold is refused with a clear error, end to end.

Real thinker, talker and code2wav servers on the tiny checkpoint behind the gateway, with the thinker's KV
pool cut to 2 MiB (about 2,000 tokens). Each open duplex session may hold an equal share of the pool with
one share kept free (docs/thinker.md, "Sessions share the KV pool"), so sessions are admitted while that
share holds a session's prefix plus ``MIN_ROOM_TOKENS``. The next session gets
``error{code:"resource_exhausted"}`` and ``session.closed{reason:"resource_exhausted"}``, while the
sessions already open still answer and close cleanly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from realtime_helpers import pcm16_b64, session_body, tone
from realtime_stages import Conn, closing_session, realtime_gateway, stage_servers

pytestmark = pytest.mark.slow

MAX_SESSIONS = 12  # far more than a 2 MiB pool admits
SHORT = {"max_response_units": 2}


@pytest.fixture()
def gateway_url(tiny_ckpt: Path, tmp_path: Path) -> Iterator[str]:
    with (
        stage_servers(tiny_ckpt, tmp_path, thinker_args=["--kv-budget", "2M"]) as stages,
        realtime_gateway(stages.addrs, seed=0, max_sessions=MAX_SESSIONS + 1) as url,
    ):
        yield f"{url}/v1/realtime?duplex=1"


def _respond(conn: Conn) -> dict:
    """One turn: audio, commit, ``response.create``. The first response opens the session's thinker stream
    (its prefix goes into the pool). Returns ``response.done``, or the ``error`` that refused the session."""
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.2))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.until("conversation.item.done", 60)
    conn.send({"type": "response.create"})
    while True:
        event = conn.recv(120)
        if event["type"] in ("response.done", "error"):
            return event


def test_the_session_the_pool_cannot_hold_is_refused_and_the_others_go_on(gateway_url: str) -> None:
    with ExitStack() as stack:
        admitted: list[Conn] = []
        refused: Conn | None = None
        for _ in range(MAX_SESSIONS):
            conn = stack.enter_context(closing_session(gateway_url))
            conn.send({"type": "session.update", "session": session_body(extra_body=SHORT)})
            conn.until("session.updated", 60)
            event = _respond(conn)
            if event["type"] == "error":
                refused = conn
                break
            assert event["response"]["status"] == "completed", event
            admitted.append(conn)
        assert refused is not None, f"{len(admitted)} sessions admitted on a 2 MiB pool"
        assert len(admitted) >= 1
        error = [e for e in refused.events if e["type"] == "error"][0]["error"]
        assert error["code"] == "resource_exhausted", error
        assert "KV cache has no room for another duplex session" in error["message"]
        closed = refused.until("session.closed", 30)
        assert closed["reason"] == "resource_exhausted"
        # The sessions already open are untouched: each still answers and closes cleanly.
        for conn in admitted:
            assert _respond(conn)["response"]["status"] == "completed"
            conn.send({"type": "session.close"})
            assert conn.until("session.closed", 30)["reason"] == "client_close"
