"""Stream a WAV (or a video's soundtrack and frames) into the realtime duplex WebSocket and save the reply.

    python examples/realtime_duplex_demo.py --url ws://127.0.0.1:8099/v1/realtime --input-wav in.wav \
        --ref-audio voice.wav --output-dir out/

Writes ``events.jsonl`` (every server event, as received), ``result.json`` (summary, ``ok``) and
``reply.wav`` (all assistant audio, 24 kHz mono). A session that ends any other way than with
``session.closed`` says how in ``result.json``: ``socket_closed{code, reason}`` (the server closed the
socket first), ``reader_error`` (the client could not handle an event), ``timeout``/``close_timeout``
(the server stayed silent for ``--timeout`` seconds); the client stops waiting as soon as it knows. Input is paced in real time by default
(``--no-realtime`` sends as fast as possible). ``--turn-lane`` commits and asks for a response explicitly
(``response.create``) instead of letting the model decide when to speak (the native lane).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

RATE = 16_000
OUT_RATE = 24_000


def read_audio_16k(path: Path) -> np.ndarray:
    import soundfile as sf
    from scipy.signal import resample_poly

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != RATE:
        g = math.gcd(int(rate), RATE)
        mono = resample_poly(mono, RATE // g, int(rate) // g).astype(np.float32)
    return mono


def wav_data_uri(path: Path) -> str:
    import soundfile as sf

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    buf = io.BytesIO()
    sf.write(buf, data.mean(axis=1), int(rate), format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def _jpeg(image: Any, max_side: int) -> bytes:
    from PIL import Image

    img: Image.Image = image
    scale = max_side / max(img.size)
    if scale < 1:
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _composite(images: list[Any]) -> Any:
    from PIL import Image

    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im.resize((w, h)), ((i % cols) * w, (i // cols) * h))
    return grid


def read_video(path: Path, fps: float, stack: int, max_side: int) -> tuple[np.ndarray, list[list[bytes]]]:
    """Soundtrack at 16 kHz and, per 1 s unit, [base frame] or [base frame, composite of ``stack`` frames]."""
    import av
    from scipy.signal import resample_poly

    with av.open(str(path)) as container:
        frames: list[tuple[float, Any]] = [
            (float(f.time or 0.0), f.to_image()) for f in container.decode(video=0)
        ]
    audio_parts: list[np.ndarray] = []
    with av.open(str(path)) as container:
        if container.streams.audio:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    audio_parts.append(out.to_ndarray().reshape(-1))
    duration = max((t for t, _ in frames), default=0.0) + 1e-3
    audio = (
        np.concatenate(audio_parts).astype(np.float32)
        if audio_parts
        else np.zeros(int(duration * RATE), np.float32)
    )
    del resample_poly
    units = max(1, math.ceil(audio.size / RATE))
    per_unit: list[list[bytes]] = []
    for k in range(units):
        picked: list[bytes] = []
        times = [k + i / max(fps, 1e-6) for i in range(max(1, round(fps)))]
        in_unit = [im for t, im in frames if k <= t < k + 1]
        if in_unit:
            base = min(frames, key=lambda f: abs(f[0] - times[0]))[1]
            picked.append(_jpeg(base, max_side))
            if stack > 1:
                step = max(1, len(in_unit) // stack)
                picked.append(_jpeg(_composite(in_unit[::step][:stack]), max_side))
        per_unit.append(picked)
    return audio, per_unit


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query)))


@dataclass
class Collector:
    events_file: Any
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    listens: int = 0
    last_seq: int = 0
    types: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.monotonic)
    session_id: str | None = None

    def record(self, event: dict[str, Any]) -> None:
        event_t = time.monotonic() - self.created_at
        self.events_file.write(json.dumps({"t": round(event_t, 4), **event}) + "\n")
        self.types.append(event["type"])
        if isinstance(event.get("server_event_seq"), int):
            self.last_seq = event["server_event_seq"]
        kind = event["type"]
        rid = event.get("response_id")
        if kind == "session.created":
            self.session_id = event["session"]["id"]
        elif kind == "response.created":
            self.responses[rid] = {"audio": [], "transcript": "", "status": None, "decision": "speak"}
            self.order.append(rid)
        elif kind == "response.output_audio.delta" and rid in self.responses:
            self.responses[rid]["audio"].append(base64.b64decode(event["delta"]))
        elif kind == "response.output_audio_transcript.delta" and rid in self.responses:
            self.responses[rid]["transcript"] += event.get("delta", "")
        elif kind == "response.done" and rid in self.responses:
            self.responses[rid]["status"] = event["response"]["status"]
        elif kind == "response.listen":
            self.listens += 1
            if rid in self.responses:
                self.responses[rid]["decision"] = "listen"
        elif kind == "error":
            self.errors.append(event["error"])


TERMINAL_EVENTS = ("session.closed", "session.expired")


class ReaderEnded(Exception):
    """The reader stopped before the awaited event arrived: the socket closed or the reader failed.

    Waiting on after that is pointless (nothing can set the event any more), so waits end at once and
    ``result.json`` says why instead of reporting a bare timeout.
    """


async def send_quietly(ws: Any, payload: dict[str, Any]) -> bool:
    """Send an ack-style message; False (nothing sent) when the socket is no longer open.

    The server closes the socket right after ``session.closed`` (docs/protocol.md, Realtime session end), so
    an ack for an event that arrived just before it regularly meets a closing connection. That is no failure,
    and above all it must not end the reader: ``session.closed`` may still be waiting in its receive buffer.
    ``send`` on a closing socket would also block until the TCP connection is gone, hence the state check.
    """
    from websockets.exceptions import ConnectionClosed
    from websockets.protocol import State

    if ws.state is not State.OPEN:
        return False
    try:
        await ws.send(json.dumps(payload))
    except ConnectionClosed:
        return False
    return True


def close_info(ws: Any) -> dict[str, Any]:
    """The close code/reason the server sent (None/"" when the connection just dropped)."""
    return {"code": ws.close_code, "reason": ws.close_reason}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import websockets
    from websockets.exceptions import ConnectionClosed

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.input_video:
        audio, unit_frames = read_video(
            Path(args.input_video), args.video_fps, args.stack_frames, args.frame_max_side
        )
    else:
        audio, unit_frames = read_audio_16k(Path(args.input_wav)), []
    session: dict[str, Any] = {
        "model": args.model,
        "modalities": ["audio", "text"],
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "sample_rate_hz": RATE,
        "turn_detection": None,
        "ref_audio": wav_data_uri(Path(args.ref_audio)),
        "overlap_policy": "listen_only",
        "playback_commit_policy": "ack_only",
        "extra_body": {"auto_response": not args.turn_lane, "force_listen_count": 0},
    }
    if args.instructions:
        session["instructions"] = args.instructions
    url = with_query(args.url, duplex="1", model=args.model, autostart="0")
    events_path = out_dir / "events.jsonl"
    result: dict[str, Any] = {"ok": False, "url": url, "input_seconds": round(audio.size / RATE, 3)}
    with events_path.open("w") as events_file:
        col = Collector(events_file)
        async with websockets.connect(url, max_size=None) as ws:
            done_events: dict[str, asyncio.Event] = {}
            closed = asyncio.Event()
            committed = asyncio.Event()
            decision_after_commit = asyncio.Event()

            async def reader() -> None:
                commit_seen = False
                try:
                    async for raw in ws:
                        event = json.loads(raw)
                        col.record(event)
                        kind = event["type"]
                        if kind in TERMINAL_EVENTS:
                            closed.set()  # the session is over: nothing to ack, the server closes the socket
                            return
                        if isinstance(event.get("server_event_seq"), int):
                            await send_quietly(
                                ws,
                                {"type": "session.event_ack", "server_event_seq": event["server_event_seq"]},
                            )
                        if kind == "response.output_audio.delta":
                            rid = event["response_id"]
                            played = event["metadata"]["audio_duration_ms"]
                            await send_quietly(
                                ws, {"type": "playback.ack", "response_id": rid, "played_ms": played}
                            )
                        if kind == "input_audio_buffer.committed":
                            commit_seen = True
                            committed.set()
                        if kind in ("response.done", "response.listen") and commit_seen:
                            decision_after_commit.set()
                        if kind == "response.done":
                            done_events.setdefault(event["response_id"], asyncio.Event()).set()
                except ConnectionClosed:
                    pass  # an abnormal close (no close frame, or an error code): reported below
                # The socket closed without a terminal session event.
                result["socket_closed"] = close_info(ws)

            read_task = asyncio.create_task(reader())

            async def until(flag: asyncio.Event, timeout: float) -> None:
                """Wait for ``flag``; ReaderEnded as soon as the reader stops, TimeoutError after ``timeout``."""
                if flag.is_set():
                    return
                waiter = asyncio.create_task(flag.wait())
                try:
                    await asyncio.wait(
                        {waiter, read_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    waiter.cancel()
                if flag.is_set():
                    return
                if read_task.done():
                    raise ReaderEnded
                raise TimeoutError

            try:
                await ws.send(json.dumps({"type": "session.update", "session": session}))
                chunk = int(RATE * args.chunk_ms / 1000)
                sent = 0
                start = time.monotonic()
                while sent < audio.size and not read_task.done():
                    piece = audio[sent : sent + chunk]
                    event: dict[str, Any] = {
                        "type": "input_audio_buffer.append",
                        "audio": base64.b64encode(
                            (np.clip(piece, -1, 1) * 32767).astype("<i2").tobytes()
                        ).decode(),
                        "format": "pcm16",
                        "sample_rate_hz": RATE,
                        "duration_ms": round(piece.size * 1000 / RATE),
                        "audio_end_ms": round((sent + piece.size) * 1000 / RATE),
                    }
                    before, after = sent // RATE, (sent + piece.size) // RATE
                    if after > before and before < len(unit_frames) and unit_frames[before]:
                        event["video_frames"] = [base64.b64encode(f).decode() for f in unit_frames[before]]
                    await ws.send(json.dumps(event))
                    sent += piece.size
                    if args.realtime:
                        await asyncio.sleep(max(0.0, start + sent / RATE - time.monotonic()))
                commit: dict[str, Any] = {"type": "input_audio_buffer.commit", "final": True}
                if args.turn_lane:
                    commit["response_create"] = True
                await ws.send(json.dumps(commit))
                try:
                    await until(committed, args.timeout)
                    await until(decision_after_commit, args.timeout)
                    pending = [r for r, v in col.responses.items() if v["status"] is None]
                    for rid in pending:
                        await until(done_events.setdefault(rid, asyncio.Event()), args.timeout)
                except TimeoutError:
                    result["timeout"] = True
                await ws.send(json.dumps({"type": "session.close"}))
                try:
                    await until(closed, args.timeout)
                except TimeoutError:
                    result["close_timeout"] = True
            except ReaderEnded:
                pass  # why the reader ended is recorded below
            except ConnectionClosed:
                result.setdefault("socket_closed", close_info(ws))
            finally:
                if not read_task.done():
                    read_task.cancel()
                await asyncio.wait({read_task})  # never raises: a reader failure is looked at just below
                if not read_task.cancelled() and read_task.exception() is not None:
                    exc = read_task.exception()
                    result["reader_error"] = f"{type(exc).__name__}: {exc}"
    pcm = b"".join(b"".join(col.responses[r]["audio"]) for r in col.order)
    with wave.open(str(out_dir / "reply.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(OUT_RATE)
        w.writeframes(pcm)
    result.update(
        session_id=col.session_id,
        responses=[
            {
                "response_id": r,
                "status": col.responses[r]["status"],
                "decision": col.responses[r]["decision"],
                "transcript": col.responses[r]["transcript"],
                "audio_deltas": len(col.responses[r]["audio"]),
                "audio_ms": sum(len(a) for a in col.responses[r]["audio"]) * 1000 // (2 * OUT_RATE),
            }
            for r in col.order
        ],
        listens=col.listens,
        errors=col.errors,
        reply_audio_ms=len(pcm) * 1000 // (2 * OUT_RATE),
        session_created="session.created" in col.types,
        session_closed="session.closed" in col.types,
    )
    decided = bool(col.order) or col.listens > 0
    result["ok"] = bool(
        result["session_created"]
        and result["session_closed"]
        and not col.errors
        and decided
        and not result.get("timeout")
        and not result.get("close_timeout")
        and "reader_error" not in result
        and (not args.require_audio or len(pcm) > 0)
    )
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8099/v1/realtime")
    p.add_argument("--model", default="openbmb/MiniCPM-o-4_5")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-wav")
    src.add_argument("--input-video", help="video file (PyAV): soundtrack plus frames per 1 s unit")
    p.add_argument("--video-fps", type=float, default=1.0)
    p.add_argument(
        "--stack-frames", type=int, default=1, help="N>1 adds a composite of N sub-frames per unit"
    )
    p.add_argument("--frame-max-side", type=int, default=960)
    p.add_argument("--ref-audio", required=True, help="WAV with the reply voice")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--instructions", default=None)
    p.add_argument("--chunk-ms", type=int, default=200)
    p.add_argument("--no-realtime", dest="realtime", action="store_false", help="send as fast as possible")
    p.add_argument(
        "--turn-lane", action="store_true", help="commit with response_create instead of model-owned turns"
    )
    p.add_argument("--require-audio", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if k != "responses"}, indent=2))
    for r in result.get("responses", []):
        print(f"{r['response_id']}: {r['status']} {r['audio_ms']} ms  {r['transcript']!r}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
