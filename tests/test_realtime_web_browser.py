"""The realtime web page's JavaScript, run in headless Chromium against the REAL pipeline.

Chromium (Debian's package, driven by Playwright through ``executable_path``) opens the page served by
``examples.online_serving.minicpmo.realtime_web``; its microphone is a WAV file (Chromium's fake capture
device), its audio output Chromium's headless sink. The page's proxy talks to the gateway (uvicorn on
loopback) in front of real thinker, talker and code2wav servers on the tiny checkpoint. The turn lane is
chosen in the page ("model decides when to speak" unchecked, then "Answer now"), so the random-weight
thinker must speak.

Three independent counts of the reply audio must agree: what the gateway sent (its Prometheus counter),
what crossed the page's WebSocket (frames seen by Chromium's network layer), and what the page's audio
output played to the end (the page's own diagnostic counter). Any console error or uncaught page
exception fails the test.
"""

from __future__ import annotations

import base64
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser_helpers import find_chromium
from gateway_server import serve_in_thread
from realtime_helpers import response_metadata, tone
from test_realtime_e2e import gateway_url, stage_addrs  # noqa: F401 - module-scoped real-stage fixtures

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is in the dev extras (scripts/setup.sh)"
)

OUT_RATE = 24_000
BROWSER_ARGS = [
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]


CHROMIUM = find_chromium()
# Decided at collection, so a machine without a browser does not start the stage servers for nothing.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium executable: scripts/setup.sh installs Debian's "
        "'chromium' only where apt-get is available and it runs as root (or set MINICPMO_CHROMIUM)",
    ),
]


def _write_wav(path: Path, x: np.ndarray, rate: int = 16_000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


@pytest.fixture()
def web_url(gateway_url: str, tmp_path: Path) -> Iterator[str]:  # noqa: F811 - the imported fixture
    from examples.online_serving.minicpmo.realtime_web.__main__ import create_app

    ref = tmp_path / "ref.wav"
    _write_wav(ref, tone(1.0, freq=180.0))
    with serve_in_thread(create_app(f"{gateway_url}/v1/realtime", ref)) as port:
        yield f"http://127.0.0.1:{port}/"


def _audio_seconds_sent() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("minicpmo_realtime_audio_seconds_total") or 0.0


def test_page_turn_lane_reply_plays_in_chromium(web_url: str, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    mic = tmp_path / "mic.wav"
    # A syllable-like amplitude envelope over a tone, so the gateway's energy check hears speech.
    t = np.arange(3 * 16_000) / 16_000
    _write_wav(mic, tone(3.0) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)).astype(np.float32))

    console_errors: list[str] = []
    received: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []
    sent_before = _audio_seconds_sent()

    def on_socket(socket: Any) -> None:
        socket.on("framereceived", lambda payload: received.append(json.loads(payload)))
        socket.on("framesent", lambda payload: sent.append(json.loads(payload)))

    def on_console(message: Any) -> None:
        if message.type == "error":
            console_errors.append(message.text)
        else:
            print(f"console {message.type}: {message.text}")

    def frames(type_: str) -> list[dict[str, Any]]:
        return [e for e in received if e["type"] == type_]

    def pump_until(done: Any, what: str, timeout: float = 240.0) -> None:
        """Let Playwright deliver events until ``done()``; the page keeps running meanwhile."""
        end = time.time() + timeout
        while not done():
            if time.time() > end or frames("error"):
                pytest.fail(
                    f"gave up waiting for {what}; received {[e['type'] for e in received][-30:]}; "
                    f"errors {frames('error')}"
                )
            page.wait_for_timeout(100)

    def close_session() -> None:
        page.click("#stop")
        page.wait_for_function("!document.getElementById('start').disabled", timeout=30_000)
        pump_until(lambda: len(frames("session.closed")) == len(frames("session.created")), "session.closed")
        assert frames("session.closed")[-1]["reason"] == "client_close"
        page.wait_for_function(
            "document.getElementById('status').textContent.startsWith('session closed')", timeout=30_000
        )
        assert page.text_content("#status") == "session closed (client_close)"

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=[*BROWSER_ARGS, f"--use-file-for-fake-audio-capture={mic}"]
        )
        try:
            page = browser.new_page(viewport={"width": 900, "height": 700})
            page.on("console", on_console)
            page.on("pageerror", lambda exc: console_errors.append(f"pageerror: {exc}"))
            page.on("websocket", on_socket)
            page.goto(web_url)
            page.uncheck("#native")  # turn lane: the page commits and asks for the response itself
            page.click("#start")
            page.wait_for_function("window.realtimeStats.appendsSent >= 8", timeout=30_000)
            assert page.is_enabled("#ask") and page.is_disabled("#native")
            page.click("#ask")
            t_ask = time.time()
            pump_until(lambda: frames("response.done"), "response.done")
            t_done = time.time()
            done = frames("response.done")[0]
            assert done["response"]["status"] == "completed", done
            deltas = frames("response.output_audio.delta")
            assert deltas and all(d["response_id"] == done["response_id"] for d in deltas)
            wire_samples = sum(len(base64.b64decode(d["delta"])) // 2 for d in deltas)
            gateway_samples = round((_audio_seconds_sent() - sent_before) * OUT_RATE)
            assert wire_samples == gateway_samples > 0

            # The page plays every received sample to the end and acknowledges what it played.
            page.wait_for_function(f"window.realtimeStats.playedSamples >= {wire_samples}", timeout=60_000)
            audio_ms = wire_samples * 1000 // OUT_RATE
            pump_until(
                lambda: any(e["event"]["played_ms"] == audio_ms for e in frames("playback.acknowledged")),
                "the final playback.acknowledged",
            )
            stats = page.evaluate("({...window.realtimeStats})")
            assert stats["receivedSamples"] == stats["playedSamples"] == wire_samples, stats
            assert stats["droppedSamples"] == 0 and stats["audioDeltas"] == len(deltas), stats
            assert page.text_content("#played") == str(wire_samples)
            assert page.text_content("#received") == str(wire_samples)
            acks = [e for e in sent if e["type"] == "playback.ack"]
            assert acks and max(a["played_ms"] for a in acks) == audio_ms

            transcript = "".join(e["delta"] for e in frames("response.output_audio_transcript.delta"))
            assert transcript.strip(), "the thinker produced no text"
            lines = page.locator("#transcript > div").all_text_contents()
            assert lines == ["you: (spoke)", "model: " + transcript], lines
            print(
                f"browser: played {stats['playedSamples']} samples ({audio_ms} ms) in {len(deltas)} deltas; "
                f"gateway sent {gateway_samples}; appends {stats['appendsSent']}; transcript {transcript!r}; "
                f"answer {t_done - t_ask:.1f} s, played and acked {time.time() - t_done:.1f} s later"
            )

            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)

            close_session()

            # Interrupt, in a fresh session (Start again): an answer cut while its first audio plays. The page
            # stops what it scheduled and plays nothing more of it; every received sample is played or dropped.
            appends = page.evaluate("window.realtimeStats.appendsSent")
            t_ask = time.time()
            page.click("#start")
            page.wait_for_function(f"window.realtimeStats.appendsSent >= {appends + 8}", timeout=30_000)
            page.click("#ask")
            # Press Interrupt from inside the page as soon as the audio is there, with the counters read in the
            # same task: a click from here could land after a loaded machine had already played it all.
            before = page.evaluate(
                """received => new Promise((resolve, reject) => {
                    const giveUp = Date.now() + 240000;
                    const poll = setInterval(() => {
                        if (Date.now() > giveUp) { clearInterval(poll); reject(new Error("no second answer")); }
                        if (window.realtimeStats.receivedSamples <= received) return;
                        clearInterval(poll);
                        const counts = {...window.realtimeStats};
                        document.getElementById("interrupt").click();
                        resolve(counts);
                    }, 5);
                })""",
                wire_samples,
            )
            print(f"browser: second answer's first audio {time.time() - t_ask:.1f} s after start")
            assert before["receivedSamples"] > before["playedSamples"] + before["droppedSamples"], before
            pump_until(lambda: len(frames("response.done")) >= 2, "the second response.done")
            page.wait_for_timeout(500)
            second = frames("response.done")[1]
            all_wire = sum(
                len(base64.b64decode(d["delta"])) // 2 for d in frames("response.output_audio.delta")
            )
            stats = page.evaluate("({...window.realtimeStats})")
            assert stats["receivedSamples"] == all_wire > wire_samples, stats
            # nothing played after the interrupt; whatever was scheduled or still arrived is dropped
            assert stats["playedSamples"] == before["playedSamples"], (before, stats)
            assert (
                stats["playedSamples"] + stats["droppedSamples"] == all_wire and stats["droppedSamples"] > 0
            ), stats
            second_played_ms = (stats["playedSamples"] - wire_samples) * 1000 // OUT_RATE
            if second["response"]["status"] == "cancelled":  # the usual case: it was still being generated
                assert second["response"]["status_details"]["reason"] == "barge_in"
                assert response_metadata(second)["playback"]["played_ms"] == second_played_ms
                assert page.locator("#transcript > div").last.text_content().endswith(" [cancelled]")
            print(
                f"browser: second response {second['response']['status']}, received {all_wire - wire_samples}, "
                f"played {stats['playedSamples'] - wire_samples}, dropped {stats['droppedSamples']} samples"
            )
            page.screenshot(path=str(tmp_path / "page-interrupted.png"), full_page=True)
            close_session()
            assert not frames("error"), frames("error")
        finally:
            browser.close()
    assert not console_errors, console_errors
