"""Chat with MiniCPM-o 4.5 through the OpenAI SDK: text, image, audio or video in; text and speech out.

Start the server first (``minicpmo-serve``, or ``bash scripts/demo.sh`` for the whole tour), then::

    python examples/openai_chat_completion_client_for_multimodal_generation.py --query-type use_audio
    python examples/openai_chat_completion_client_for_multimodal_generation.py --query-type use_image \
        --modalities text --stream
    python examples/openai_chat_completion_client_for_multimodal_generation.py --query-type use_video \
        --video-path clip.mp4 --output reply.wav

Without ``--image-path/--audio-path/--video-path`` the client synthesises a small sample (a gradient
image, a 1.5 s tone, a 3 s clip with a soundtrack), so it runs with no files at hand. The reply's speech
is saved as a 24 kHz WAV (``--output``); with ``--stream`` text deltas are printed as they arrive and the
audio chunks are appended to the same WAV.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path

import numpy as np

MODEL = "openbmb/MiniCPM-o-4_5"
DEFAULT_PROMPTS = {
    "text": "Say hello and introduce yourself in one sentence.",
    "use_image": "What is in this image?",
    "use_audio": "What do you hear in this audio?",
    "use_video": "Describe what happens in this video.",
}


# ---- sample media ---------------------------------------------------------------------------------
def sample_image_png() -> bytes:
    from PIL import Image

    y, x = np.mgrid[0:224, 0:224]
    rgb = np.stack([x, y, np.full_like(x, 160)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def sample_audio_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * t) * t)
    buf = io.BytesIO()
    sf.write(buf, tone.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def sample_video_mp4(seconds: float = 3.0, fps: int = 8) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        vs = out.add_stream("mpeg4", rate=fps)
        vs.width, vs.height, vs.pix_fmt = 160, 120, "yuv420p"
        aus = out.add_stream("aac", rate=16000)
        aus.layout = "mono"
        for i in range(int(seconds * fps)):
            img = np.zeros((120, 160, 3), dtype=np.uint8)
            img[:, : (i * 7) % 160, 0] = 220
            for packet in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in vs.encode():
            out.mux(packet)
        tone = (0.2 * np.sin(2 * np.pi * 330 * np.arange(int(seconds * 16000)) / 16000)).astype(np.float32)
        for start in range(0, tone.size, 1024):
            frame = av.AudioFrame.from_ndarray(tone[None, start : start + 1024], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, start
            for packet in aus.encode(frame):
                out.mux(packet)
        for packet in aus.encode():
            out.mux(packet)
    return buf.getvalue()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _read(path: str | None, fallback) -> bytes:  # type: ignore[no-untyped-def]
    return Path(path).read_bytes() if path else fallback()


def build_content(args: argparse.Namespace) -> list[dict]:
    prompt = args.prompt or DEFAULT_PROMPTS[args.query_type]
    parts: list[dict] = []
    if args.query_type == "use_image":
        parts.append(
            {
                "type": "image_url",
                "image_url": {"url": _data_url(_read(args.image_path, sample_image_png), "image/png")},
            }
        )
    elif args.query_type == "use_audio":
        wav = _read(args.audio_path, sample_audio_wav)
        parts.append(
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
        )
    elif args.query_type == "use_video":
        parts.append(
            {
                "type": "video_url",
                "video_url": {"url": _data_url(_read(args.video_path, sample_video_mp4), "video/mp4")},
            }
        )
    parts.append({"type": "text", "text": prompt})
    return parts


# ---- audio output ---------------------------------------------------------------------------------
def _pcm_from_wav(data: bytes) -> np.ndarray:
    import soundfile as sf

    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    if rate != 24000:
        raise ValueError(f"expected 24 kHz audio, got {rate}")
    return samples.reshape(-1)


def save_wav(path: str, pcm16: np.ndarray) -> None:
    import soundfile as sf

    sf.write(path, pcm16, 24000, subtype="PCM_16")


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    client = OpenAI(
        base_url=f"http://{args.host}:{args.port}/v1", api_key=args.api_key or "EMPTY", timeout=args.timeout
    )
    modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    want_audio = "audio" in modalities
    extra_body: dict = {"chat_template_kwargs": {"use_tts_template": want_audio, "enable_thinking": False}}
    if args.ref_audio:
        extra_body["ref_audio"] = _data_url(Path(args.ref_audio).read_bytes(), "audio/wav")
    if args.max_tokens:
        extra_body["max_tokens"] = args.max_tokens
    request = dict(
        model=args.model,
        messages=[{"role": "user", "content": build_content(args)}],
        modalities=modalities,
        extra_body=extra_body,
    )
    if want_audio:
        # OpenAI's audio object: streamed speech arrives as 24 kHz PCM16 in delta.audio.data, the words as
        # delta.audio.transcript; a complete reply carries one WAV in message.audio.data.
        request["audio"] = {"voice": "default", "format": "pcm16" if args.stream else "wav"}
    t0 = time.perf_counter()
    pieces: list[np.ndarray] = []
    text = ""
    if args.stream:
        first_audio = None
        finish_reasons = []
        for chunk in client.chat.completions.create(stream=True, **request):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            # delta.audio is a typed field in newer openai SDKs and an extra key in older ones.
            raw = getattr(choice.delta, "audio", None) or (choice.delta.model_extra or {}).get("audio")
            audio = raw.model_dump() if hasattr(raw, "model_dump") else (raw or {})
            content = choice.delta.content or audio.get("transcript") or ""
            if audio.get("data"):
                first_audio = first_audio or time.perf_counter() - t0
                pcm16 = np.frombuffer(base64.b64decode(audio["data"]), dtype="<i2")
                pieces.append(pcm16.astype(np.float32) / 32768.0)
            if content:
                text += content
                print(content, end="", flush=True)
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
        print()
        print(
            f"[client] finish_reason={finish_reasons} time_to_first_audio="
            f"{f'{first_audio:.2f}s' if first_audio is not None else 'n/a'}"
        )
    else:
        resp = client.chat.completions.create(**request)
        message = resp.choices[0].message
        text = message.content or (message.audio.transcript if message.audio is not None else "")
        print(text)
        if message.audio is not None:
            pieces.append(_pcm_from_wav(base64.b64decode(message.audio.data)))
        print(f"[client] finish_reason={resp.choices[0].finish_reason} usage={resp.usage.model_dump()}")
    elapsed = time.perf_counter() - t0
    if want_audio:
        if not pieces:
            print("[client] audio was requested but none arrived", file=sys.stderr)
            return 1
        pcm = np.concatenate(pieces)
        save_wav(args.output, pcm)
        print(f"[client] saved {pcm.size / 24000:.2f} s of 24 kHz speech to {args.output}")
    print(f"[client] {len(text)} characters of text in {elapsed:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--query-type", choices=["text", "use_image", "use_audio", "use_video"], default="text")
    p.add_argument("--modalities", default="text,audio", help="comma list of output modalities: text, audio")
    p.add_argument("--prompt", default=None)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8099)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--api-key", default=None)
    p.add_argument("--image-path", default=None)
    p.add_argument("--audio-path", default=None)
    p.add_argument("--video-path", default=None)
    p.add_argument("--ref-audio", default=None, help="reference voice WAV for the reply")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--output", default="output_audio.wav", help="where the reply's speech is saved")
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
