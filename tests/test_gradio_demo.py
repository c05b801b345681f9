"""The Gradio demo (examples/online_serving/minicpmo/gradio_demo.py) run as a user runs it, in front of
the embedded launcher on the tiny checkpoint: driven through its HTTP API with ``gradio_client`` (text +
image + audio in, streamed text and speech out with a reference voice, the WAV saved; thinking on, text
only) and once in headless Chromium (the page's own Send button; a screenshot goes to the test log, and
any console error fails the test)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from browser_helpers import find_chromium
from gateway_server import free_port
from launched_pipeline import Served, launched
from media_samples import png_bytes, wav_bytes

gradio_client = pytest.importorskip(
    "gradio_client", reason="gradio-client is in the dev extras (scripts/setup.sh)"
)
pytest.importorskip("gradio", reason="gradio is in the dev extras (scripts/setup.sh)")
REPO = Path(__file__).resolve().parents[1]


def test_history_and_request_shapes(tmp_path: Path) -> None:
    """Gradio 6 hands the history back as content-part lists: earlier turns reach the request as text."""
    from examples.online_serving.minicpmo import gradio_demo as g

    image = tmp_path / "in.png"
    image.write_bytes(png_bytes())
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "assistant", "content": [{"type": "file"}]},
    ]
    messages = g.build_messages("And this?", str(image), None, None, history)
    assert messages[:2] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    parts = messages[2]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    body = g.request_body("m", messages, speak=False, thinking=True, ref_voice=None, max_tokens=8)
    assert body["modalities"] == ["text"] and body["chat_template_kwargs"] == {
        "use_tts_template": False,
        "enable_thinking": True,
    }
    voice = tmp_path / "v.wav"
    voice.write_bytes(wav_bytes(1.0, rate=44_100))
    spoken = g.request_body("m", messages, speak=True, thinking=False, ref_voice=str(voice), max_tokens=8)
    assert spoken["modalities"] == ["text", "audio"] and spoken["ref_audio"].startswith(
        "data:audio/wav;base64,"
    )


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launched(tiny_ckpt, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def demo_url(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "demo.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "GRADIO_TEMP_DIR": str(log.parent)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "examples.online_serving.minicpmo.gradio_demo",
                "--api-base",
                f"{served.url}/v1",
                "--port",
                str(port),
                "--max-tokens",
                "12",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the demo did not start:\n{log.read_text()}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
def test_spoken_reply_with_media_and_reference_voice(demo_url: str, tmp_path: Path) -> None:
    image, audio, voice = tmp_path / "in.png", tmp_path / "in.wav", tmp_path / "voice.wav"
    image.write_bytes(png_bytes(96, 64))
    audio.write_bytes(wav_bytes(1.0))
    voice.write_bytes(wav_bytes(1.0, freq=180.0))
    client = gradio_client.Client(demo_url, verbose=False)
    handle = gradio_client.handle_file
    history, _speech, saved = client.predict(
        "What do you see and hear?",
        handle(str(image)),
        handle(str(audio)),
        None,
        handle(str(voice)),
        True,
        False,
        [],
        api_name="/respond",
    )
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[-1]["content"] and "[error" not in str(history[-1]["content"]), history
    samples, rate = sf.read(saved)
    assert rate == 24_000 and samples.size > 0  # the streamed speech, saved whole


@pytest.mark.slow
def test_text_only_with_thinking(demo_url: str) -> None:
    client = gradio_client.Client(demo_url, verbose=False)
    history, _speech, saved = client.predict(
        "Hello", None, None, None, None, False, True, [], api_name="/respond"
    )
    assert history[-1]["role"] == "assistant" and history[-1]["content"], history
    assert "[error" not in str(history[-1]["content"]) and saved is None


@pytest.mark.slow
@pytest.mark.skipif(
    find_chromium() is None,
    reason="no Chromium executable (scripts/setup.sh installs Debian's "
    "'chromium' where apt-get runs as root, or set MINICPMO_CHROMIUM)",
)
def test_page_in_headless_chromium(demo_url: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_chromium(), headless=True)
        page = browser.new_page()
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(demo_url, wait_until="networkidle")
        page.get_by_label("Speak the answer").uncheck()
        page.get_by_label("Message").fill("Hello there")
        page.get_by_role("button", name="Send").click()
        bot = page.locator("[data-testid='bot']").last
        bot.wait_for(timeout=300_000)
        text, deadline = "", time.monotonic() + 300
        while time.monotonic() < deadline:  # the reply streams in: wait until it stops growing
            page.wait_for_timeout(2_000)
            now = bot.inner_text()
            if now and now == text:
                break
            text = now
        shot = tmp_path / "gradio_demo.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"gradio demo screenshot: {shot}")
        browser.close()
    assert text.strip(), "the assistant's reply did not appear"
    assert errors == [], errors
