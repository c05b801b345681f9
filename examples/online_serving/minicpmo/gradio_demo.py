"""A Gradio chat page for a running MiniCPM-o server: text, image, audio and video in; streamed text and
speech out.

    python -m examples.online_serving.minicpmo.gradio_demo --api-base http://127.0.0.1:8099/v1 \\
        --model openbmb/MiniCPM-o-4_5 --port 7862
    # or: bash examples/online_serving/minicpmo/run_gradio_demo.sh

Each turn is one streaming ``/v1/chat/completions`` request: the typed text plus whatever image, audio
(upload or microphone) and video were attached, earlier turns as plain text. "Speak the answer" asks for
``modalities: ["text", "audio"]`` with the TTS template, and the reply's speech plays as its chunks arrive
(Gradio streams audio through ffmpeg; without ffmpeg on PATH it plays once complete) and is saved as a
24 kHz WAV offered for download; a reference voice (any audio file) is sent as
``ref_audio`` to clone it. "Thinking" sets ``chat_template_kwargs.enable_thinking``. The page loads no
web fonts and sends no analytics, so it works offline.

The HTTP API Gradio generates (``/gradio_api/...``) drives the same function: ``respond`` (see
tests/test_gradio_demo.py, which uses ``gradio_client``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run by path (python examples/...py): the repository root goes first on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.online_serving.minicpmo.eval_media import data_url  # noqa: E402
from services.common.audio import float_to_pcm16, read_audio, resample, wav_bytes, write_wav  # noqa: E402

OUTPUT_RATE = 24_000
_MIME = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".gif": "image/gif",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
    ".mkv": "video/x-matroska",
    ".avi": "video/x-msvideo",
}


def _file_url(path: str) -> str:
    return data_url(Path(path).read_bytes(), _MIME.get(Path(path).suffix.lower(), "application/octet-stream"))


def _history_text(content: Any) -> str:
    """The text of one chat-history message: Gradio 6 hands back ``[{"type": "text", "text": …}, …]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def build_messages(
    text: str, image: str | None, audio: str | None, video: str | None, history: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Earlier turns as text, then this turn's media parts and text (the order a user attached them in
    the page: image, audio, video, text)."""
    messages = [
        {"role": m["role"], "content": _history_text(m.get("content"))}
        for m in history
        if m.get("role") in ("user", "assistant") and _history_text(m.get("content"))
    ]
    parts: list[dict[str, Any]] = []
    if image:
        parts.append({"type": "image_url", "image_url": {"url": _file_url(image)}})
    if audio:
        parts.append(
            {
                "type": "input_audio",
                "input_audio": {"data": data_url(Path(audio).read_bytes(), "audio/wav"), "format": "wav"},
            }
        )
    if video:
        parts.append({"type": "video_url", "video_url": {"url": _file_url(video)}})
    parts.append({"type": "text", "text": text or "Describe what you received."})
    return [*messages, {"role": "user", "content": parts}]


def request_body(
    model: str,
    messages: list[dict[str, Any]],
    speak: bool,
    thinking: bool,
    ref_voice: str | None,
    max_tokens: int,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "modalities": ["text", "audio"] if speak else ["text"],
        "chat_template_kwargs": {"use_tts_template": speak, "enable_thinking": thinking},
    }
    if speak:
        # No OpenAI ``audio`` object: the vLLM-Omni dialect, each speech chunk a WAV in delta.content.
        if ref_voice:
            samples, rate = read_audio(ref_voice)
            body["ref_audio"] = data_url(wav_bytes(resample(samples, rate, 16_000), 16_000), "audio/wav")
    return body


def stream_reply(
    api_base: str, body: dict[str, Any], api_key: str | None, timeout: float
) -> Iterator[tuple[str, Any]]:
    """``("text", str)`` and ``("audio", float32 24 kHz)`` pieces of a streaming reply, in arrival order.
    A non-200 answer raises ``RuntimeError`` with the server's message."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.stream(
        "POST", f"{api_base}/chat/completions", json=body, headers=headers, timeout=timeout
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"server answered {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if not content:
                    continue
                if chunk.get("modality") == "audio":
                    samples, rate = read_audio(base64.b64decode(content))
                    yield "audio", resample(samples, rate, OUTPUT_RATE)
                else:
                    yield "text", content


def make_respond(args: argparse.Namespace, streaming: bool = True):  # noqa: ANN201 - a Gradio generator
    """The turn handler; ``streaming``: hand each speech chunk to the player as it arrives (else the whole
    reply once it is complete)."""
    import gradio as gr

    def respond(
        text: str,
        image: str | None,
        audio: str | None,
        video: str | None,
        ref_voice: str | None,
        speak: bool,
        thinking: bool,
        history: list[dict[str, Any]] | None,
    ):
        """One turn: yields (chat history, new speech chunk, saved WAV) as the reply streams in."""
        history = list(history or [])
        messages = build_messages(text, image, audio, video, history)
        body = request_body(args.model, messages, speak, thinking, ref_voice, args.max_tokens)
        history += [{"role": "user", "content": text or "(media)"}, {"role": "assistant", "content": ""}]
        speech: list[np.ndarray] = []
        try:
            for kind, piece in stream_reply(args.api_base, body, args.api_key, args.timeout):
                if kind == "text":
                    history[-1]["content"] += piece
                    yield history, gr.skip(), gr.skip()
                else:
                    speech.append(piece)
                    if streaming:
                        yield history, (OUTPUT_RATE, float_to_pcm16(piece)), gr.skip()
        except (RuntimeError, httpx.HTTPError, ValueError) as exc:
            history[-1]["content"] += f"\n[error: {exc}]"
            yield history, gr.skip(), None
            return
        if not speech:
            yield history, gr.skip(), None
            return
        fd, wav = tempfile.mkstemp(suffix=".wav", prefix="minicpmo-reply-")
        os.close(fd)
        write_wav(wav, np.concatenate(speech), OUTPUT_RATE)
        yield history, gr.skip() if streaming else wav, wav

    return respond


def offline_theme():  # noqa: ANN201 - a gradio theme
    """System fonts only: the default theme would fetch web fonts, which fail offline."""
    import gradio as gr

    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )


def build_demo(args: argparse.Namespace):  # noqa: ANN201 - gr.Blocks
    import gradio as gr

    with gr.Blocks(title="MiniCPM-o 4.5", analytics_enabled=False) as demo:
        gr.Markdown(f"### MiniCPM-o 4.5 — `{args.model}` at `{args.api_base}`")
        chat = gr.Chatbot(label="Conversation", height=360)
        with gr.Row():
            text = gr.Textbox(label="Message", placeholder="Ask about the attached media…", scale=4)
            send = gr.Button("Send", variant="primary", scale=1)
        with gr.Row():
            image = gr.Image(type="filepath", label="Image")
            audio = gr.Audio(sources=["upload", "microphone"], type="filepath", label="Audio")
            video = gr.Video(label="Video")
        with gr.Row():
            ref_voice = gr.Audio(sources=["upload"], type="filepath", label="Reference voice (optional)")
            with gr.Column():
                speak = gr.Checkbox(value=True, label="Speak the answer")
                thinking = gr.Checkbox(value=False, label="Thinking")
        # Gradio streams audio through ffmpeg (AAC); without it the whole reply is played once complete.
        streaming = shutil.which("ffmpeg") is not None
        speech = gr.Audio(label="Speech", streaming=streaming, autoplay=True, interactive=False)
        saved = gr.File(label="Saved reply (WAV)")
        inputs = [text, image, audio, video, ref_voice, speak, thinking, chat]
        respond = make_respond(args, streaming)
        send.click(respond, inputs, [chat, speech, saved], api_name="respond")
        text.submit(respond, inputs, [chat, speech, saved], api_name=False)
    return demo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Gradio chat page for a MiniCPM-o server")
    ap.add_argument("--api-base", default="http://127.0.0.1:8099/v1")
    ap.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    ap.add_argument("--host", default="127.0.0.1", help="address the page binds (0.0.0.0 to share on a LAN)")
    ap.add_argument("--port", type=int, default=7862)
    ap.add_argument("--api-key", default=os.environ.get("MINICPMO_API_KEY"))
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.api_base = args.api_base.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    args = parse_args(argv)
    build_demo(args).queue(default_concurrency_limit=4).launch(
        server_name=args.host, server_port=args.port, theme=offline_theme(), show_error=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
