"""``generate``: one realtime duplex session per sample, its spoken text timed on the media clock.

Per sample: ``/v1/realtime?duplex=1&autostart=0``, a ``session.update`` for the model-native lane
(``extra_body.auto_response: true``, ``overlap_policy: listen_only``, ``playback_commit_policy:
ack_only``), then the sample as 1 s units: each ``input_audio_buffer.append`` carries one second of the
question audio (silence once it is over, until the video ends), the video frame of that second
(``video_frames``, 1 fps) and the cumulative ``audio_end_ms``. With ``--pace realtime`` unit k is sent
k seconds after the first one; playback is acknowledged every 250 ms as if every received chunk played
at once. After the last unit: commit, wait for the open responses to finish (at most the video's
length + 20 s), close.

The **media clock** of a text delta is the ``audio_end_ms`` streamed when it arrived: what the user had
heard and seen by then. Text is cut into sentences at terminal punctuation; a sentence starts at its
first delta's clock and ends at its last's. Only real-time pacing makes that clock mean anything, so
``--pace as-fast-as-possible`` records ``clock: invalid`` and ``evaluate`` refuses it unless told.

Writes ``RESPONSE_ROOT/<split>/<id>.json`` (``[{sentence, start, end}]``, seconds),
``<id>.meta.json`` and ``RESPONSE_ROOT/duplex_metrics.json``. A sample whose output exists is skipped
(``--overwrite`` redoes it), so an interrupted run resumes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import websockets

from examples.online_serving.minicpmo.eval_media import AUDIO_RATE, data_url, frames_at, load_audio_16k
from examples.online_serving.minicpmo.omni_duplex_eval.dataset import Sample
from services.common.audio import float_to_pcm16

PACES = ("realtime", "as-fast-as-possible")
TEXT_DELTAS = ("response.output_audio_transcript.delta", "response.output_text.delta")
_SENTENCE = re.compile(r".+?(?:[.!?。！？]+(?=\s|$)|$)", re.S)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after runs of terminal punctuation followed by a space or the end."""
    return [m.group(0).strip() for m in _SENTENCE.finditer(text.strip()) if m.group(0).strip()]


def timed_sentences(deltas: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """``[(delta, media_clock_ms)]`` in arrival order -> ``[{sentence, start, end}]`` (seconds)."""
    out: list[dict[str, Any]] = []
    pending, start, last = "", None, 0
    for delta, clock in deltas:
        if not delta:
            continue
        if start is None:
            start = clock
        pending += delta
        last = clock
        pieces = split_sentences(pending)
        closed = pieces if re.search(r"[.!?。！？]\s*$", pending) else pieces[:-1]
        for sentence in closed:
            out.append({"sentence": sentence, "start": start / 1000, "end": max(start, clock) / 1000})
        if closed:
            pending = pending.strip()
            for sentence in closed:
                pending = pending[pending.index(sentence) + len(sentence) :]
            pending = pending.lstrip()
            start = clock if pending else None
    if pending.strip():
        out.append({"sentence": pending.strip(), "start": (start or last) / 1000, "end": last / 1000})
    return out


@dataclass
class SessionLog:
    """What one session saw: every event with its media clock, and the bookkeeping for acks and draining."""

    events: list[dict[str, Any]] = field(default_factory=list)
    clock_ms: int = 0  # audio_end_ms of the last append sent
    text: list[tuple[str, int]] = field(default_factory=list)
    open_responses: set[str] = field(default_factory=set)
    audio_ms: dict[str, int] = field(default_factory=dict)
    acked_ms: dict[str, int] = field(default_factory=dict)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    created: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, event: dict[str, Any]) -> None:
        kind = event.get("type", "")
        self.events.append({"type": kind, "media_clock_ms": self.clock_ms, "received_at": time.time()})
        rid = event.get("response_id")
        if kind == "session.created":
            self.created.set()
        elif kind == "response.created" and rid:
            self.open_responses.add(rid)
        elif kind == "response.done" and rid:
            self.open_responses.discard(rid)
        elif kind == "response.output_audio.delta" and rid:
            self.audio_ms[rid] = int((event.get("metadata") or {}).get("audio_duration_ms") or 0)
        elif kind in TEXT_DELTAS:
            self.text.append((str(event.get("delta") or ""), self.clock_ms))
        elif kind == "input_audio_buffer.committed" or (
            kind == "error" and (event.get("error") or {}).get("code") == "input_audio_buffer_empty"
        ):
            self.committed.set()  # the final commit was answered (nothing left over is an answer too)
        elif kind in ("session.closed", "session.expired"):
            self.closed.set()
        if self.committed.is_set() and not self.open_responses:
            self.settled.set()
        elif self.open_responses:
            self.settled.clear()


def units(sample: Sample, fps: float = 1.0) -> tuple[list[np.ndarray], list[bytes]]:
    """One second of audio (question, then silence) and one frame per unit, as many units as the longer
    of the video and the question."""
    audio = load_audio_16k(sample.question_audio)
    frames = frames_at(sample.video, fps=fps, max_frames=3_600)
    seconds = max(len(frames), -(-audio.size // AUDIO_RATE), int(np.ceil(sample.video_duration or 0)), 1)
    padded = np.zeros(seconds * AUDIO_RATE, dtype=np.float32)
    padded[: min(audio.size, padded.size)] = audio[: padded.size]
    frames = [frames[min(k, len(frames) - 1)] for k in range(seconds)]
    return [padded[k * AUDIO_RATE : (k + 1) * AUDIO_RATE] for k in range(seconds)], frames


def realtime_url(base: str, model: str) -> str:
    ws = base.rstrip("/").replace("https://", "wss://").replace("http://", "ws://")
    ws = ws.removesuffix("/v1")
    return f"{ws}/v1/realtime?{urlencode({'duplex': 1, 'model': model, 'autostart': 0})}"


def session_update(model: str, ref_audio: bytes | None) -> dict[str, Any]:
    session: dict[str, Any] = {
        "model": model,
        "modalities": ["audio", "text"] if ref_audio else ["text"],
        "input_audio_format": "pcm16",
        "sample_rate_hz": AUDIO_RATE,
        "turn_detection": None,
        "overlap_policy": "listen_only",
        "playback_commit_policy": "ack_only",
        "extra_body": {"auto_response": True},
    }
    if ref_audio:
        session["ref_audio"] = data_url(ref_audio, "audio/wav")
    return {"type": "session.update", "session": session}


async def _reader(ws: Any, log: SessionLog) -> None:
    try:
        async for raw in ws:
            log.record(json.loads(raw))
    except websockets.ConnectionClosed:
        pass
    finally:
        log.closed.set()


async def _acker(ws: Any, log: SessionLog) -> None:
    while True:
        await asyncio.sleep(0.25)
        for rid, ms in list(log.audio_ms.items()):
            if ms > log.acked_ms.get(rid, 0) and rid in log.open_responses:
                await ws.send(
                    json.dumps(
                        {
                            "type": "playback.ack",
                            "response_id": rid,
                            "item_id": f"item_{rid}",
                            "played_ms": ms,
                        }
                    )
                )
                log.acked_ms[rid] = ms


async def run_session(
    sample: Sample, url: str, model: str, ref_audio: bytes | None, pace: str
) -> dict[str, Any]:
    """Stream one sample through one session; returns what the output and meta files are made of."""
    audio_units, frames = await asyncio.to_thread(units, sample)
    log = SessionLog()
    drain_timeout = close_timeout = None
    async with websockets.connect(url, max_size=None, open_timeout=60) as ws:
        reader = asyncio.create_task(_reader(ws, log))
        await ws.send(json.dumps(session_update(model, ref_audio)))
        await asyncio.wait_for(log.created.wait(), 60)
        acker = asyncio.create_task(_acker(ws, log))
        t0 = time.monotonic()
        for k, (pcm, frame) in enumerate(zip(audio_units, frames, strict=True)):
            if pace == "realtime":
                await asyncio.sleep(max(0.0, t0 + k - time.monotonic()))
            end_ms = (k + 1) * 1000
            await ws.send(
                json.dumps(
                    {
                        "type": "input_audio_buffer.append",
                        "audio": base64.b64encode(float_to_pcm16(pcm).tobytes()).decode(),
                        "audio_end_ms": end_ms,
                        "video_frames": [base64.b64encode(frame).decode()],
                    }
                )
            )
            log.clock_ms = end_ms
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        try:
            await asyncio.wait_for(log.settled.wait(), max(20.0, len(audio_units) + 20.0))
        except TimeoutError:
            drain_timeout = f"responses still open after the drain window: {sorted(log.open_responses)}"
        acker.cancel()
        await ws.send(json.dumps({"type": "session.close"}))
        try:
            await asyncio.wait_for(log.closed.wait(), 20)
        except TimeoutError:
            close_timeout = "no session.closed within 20 s"
        reader.cancel()
    types = [e["type"] for e in log.events]
    return {
        "sentences": timed_sentences(log.text),
        "units": len(audio_units),
        "response_done": "response.done" in types,
        "drain_timeout": drain_timeout,
        "close_timeout": close_timeout,
        "metrics": {
            "responses": types.count("response.created"),
            "listens": types.count("response.listen"),
            "errors": types.count("error"),
            "first_text_media_ms": next((clock for delta, clock in log.text if delta.strip()), None),
            "wall_s": round(time.monotonic() - t0, 3),
        },
    }


def output_paths(root: Path, sample: Sample) -> tuple[Path, Path]:
    out = root / sample.split / f"{sample.id}.json"
    return out, out.with_name(f"{sample.id}.meta.json")


async def generate(samples: list[Sample], args: Any) -> list[dict[str, Any]]:
    """Every sample (``args.concurrency`` sessions at a time); returns the per-sample metrics rows."""
    ref = args.ref_audio.read_bytes() if args.ref_audio else None
    url = realtime_url(args.url, args.model)
    sem = asyncio.Semaphore(args.concurrency)
    rows: list[dict[str, Any]] = []

    async def one(sample: Sample) -> None:
        out, meta_path = output_paths(args.response_root, sample)
        if out.exists() and meta_path.exists() and not args.overwrite:
            return
        async with sem:
            try:
                result = await run_session(sample, url, args.model, ref, args.pace)
            except (OSError, ValueError, TimeoutError, websockets.WebSocketException) as exc:
                rows.append({"id": sample.id, "split": sample.split, "error": f"{type(exc).__name__}: {exc}"})
                return
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result["sentences"], ensure_ascii=False, indent=2))
        meta = {
            "id": sample.id,
            "split": sample.split,
            "clock": "media" if args.pace == "realtime" else "invalid",
            "pace": args.pace,
            "fps": 1,
            "unit_ms": 1000,
            "units": result["units"],
            "model": args.model,
            "response_done": result["response_done"],
            "drain_timeout": result["drain_timeout"],
            "close_timeout": result["close_timeout"],
            "ref_audio_sha256": hashlib.sha256(ref).hexdigest() if ref else None,
        }
        meta_path.write_text(json.dumps(meta, indent=2))
        rows.append({"id": sample.id, "split": sample.split, **result["metrics"]})

    await asyncio.gather(*(one(s) for s in samples))
    return rows
