"""The controlled realtime workload of ``bench.realtime_duplex``: one client session, paced in real time.

Two scripts, each run by one session for at least the plan's ``duration_s`` seconds of wall time:

* **turn lane** (``turn_session``): a cycle of [2 s of speech appended in real time (200 ms appends),
  commit + ``response.create``, the whole response (it speaks up to ``units`` units), 2 s of speech,
  commit + ``response.create``, a barge-in at that response's first audio delta], repeated until the
  duration is over (the last cycle finishes);
* **native lane** (``native_session``): the microphone streams continuously in real time, 2 s of speech
  then 4 s of silence, the model decides when to speak; at the end a final commit, after which the
  session clocks the model with silent units until every response has completed.

Both observe every response through :class:`ResponseClock`, the client-side playout model of the issue:
playback starts 200 ms after a response's first audio delta and consumes audio in real time; an
**underrun** is the playout running out of received audio before the next delta arrives (counted, and
its length summed). A response's **unit RTF** values are, per audio delta after the first, the time
since the previous delta divided by the audio that delta carried (< 1: produced faster than real time).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

APPEND_S = 0.2
PLAYOUT_LEAD_S = 0.2  # the client starts playing 200 ms after the first audio delta
OUT_RATE = 24_000


def pcm16_b64(seconds: float, freq: float = 220.0, amp: float = 0.3) -> str:
    t = np.arange(int(seconds * 16_000)) / 16_000
    return base64.b64encode((amp * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()).decode()


@dataclass
class ResponseClock:
    """Timing of one response as a client that plays it sees it (see the module docstring)."""

    started: float  # when the request that caused it was sent (commit), or its response.created
    first_audio: float | None = None
    last_delta: float | None = None
    play_end: float = 0.0  # when the playout runs out of the audio received so far
    audio_s: float = 0.0
    unit_rtf: list[float] = field(default_factory=list)
    underruns: int = 0
    underrun_ms: float = 0.0
    # (when, ms) of each underrun, ``when`` on the host's monotonic clock: underruns of several
    # sessions at the same moment are one stall of the pipeline, not per-session slowness.
    underrun_at: list[tuple[float, float]] = field(default_factory=list)
    status: str | None = None

    def on_delta(self, now: float, pcm16_bytes: int) -> None:
        seconds = pcm16_bytes / 2 / OUT_RATE
        if seconds <= 0:
            return
        if self.first_audio is None:
            self.first_audio = now
            self.play_end = now + PLAYOUT_LEAD_S + seconds
        else:
            assert self.last_delta is not None
            self.unit_rtf.append((now - self.last_delta) / seconds)
            if now > self.play_end:
                self.underruns += 1
                self.underrun_ms += 1000 * (now - self.play_end)
                self.underrun_at.append((now, 1000 * (now - self.play_end)))
                self.play_end = now + seconds  # playback resumes with this delta
            else:
                self.play_end += seconds
        self.last_delta = now
        self.audio_s += seconds


@dataclass
class SessionResult:
    lane: str
    responses: list[ResponseClock] = field(default_factory=list)
    first_audio_s: list[float] = field(default_factory=list)  # commit -> first audio delta (turn lane)
    barge_in_ms: list[float] = field(default_factory=list)  # barge_in sent -> cancelled response.done
    errors: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "lane": self.lane,
            "responses": len(self.responses),
            "completed": sum(r.status == "completed" for r in self.responses),
            "cancelled": sum(r.status == "cancelled" for r in self.responses),
            "underruns": sum(r.underruns for r in self.responses),
            "underrun_ms": sum(r.underrun_ms for r in self.responses),
            "underrun_at": [u for r in self.responses for u in r.underrun_at],
            "audio_s": sum(r.audio_s for r in self.responses),
            "errors": self.errors,
        }


class Client:
    """One socket: a reader task records every event; the script waits on the events it needs."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            event = json.loads(raw)
            event["_t"] = time.monotonic()
            await self.queue.put(event)

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def next(self, timeout: float) -> dict[str, Any]:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def stream(self, seconds: float, speech: bool) -> None:
        """Append ``seconds`` of audio (a tone, or silence) in real-time-paced 200 ms pieces."""
        piece = pcm16_b64(APPEND_S, amp=0.3 if speech else 0.0)
        start = time.monotonic()
        for i in range(round(seconds / APPEND_S)):
            await self.send({"type": "input_audio_buffer.append", "audio": piece})
            await asyncio.sleep(max(0.0, start + (i + 1) * APPEND_S - time.monotonic()))


def _session(ref_uri: str, extra_body: dict[str, Any]) -> dict[str, Any]:
    """The opening ``session`` object of a benchmark session (spoken replies in the given lane)."""
    return {
        "modalities": ["audio", "text"],
        "ref_audio": ref_uri,
        "turn_detection": None,
        "extra_body": extra_body,
    }


async def _open(url: str, session: dict[str, Any]) -> Any:
    import websockets

    ws = await websockets.connect(f"{url}/v1/realtime?duplex=1&autostart=0", max_size=None)
    client = Client(ws)
    await client.send({"type": "session.update", "session": session})
    while (await client.next(60))["type"] != "session.updated":
        pass
    return client


async def _response(
    client: Client, result: SessionResult, sent: float, barge_at: int | None, timeout: float
) -> None:
    """Follow one response from its request to its ``response.done``; barge in at delta ``barge_at``."""
    clock = ResponseClock(started=sent)
    result.responses.append(clock)
    deltas, barged = 0, None
    while True:
        event = await client.next(timeout)
        kind = event["type"]
        if kind == "error":
            result.errors.append(event["error"])
        elif kind == "response.output_audio.delta":
            clock.on_delta(event["_t"], len(base64.b64decode(event["delta"])))
            deltas += 1
            if deltas == 1:
                result.first_audio_s.append(event["_t"] - sent)
            if barge_at is not None and deltas == barge_at and barged is None:
                barged = time.monotonic()
                await client.send({"type": "barge_in"})
        elif kind == "response.done":
            clock.status = event["response"]["status"]
            if barged is not None and clock.status == "cancelled":
                result.barge_in_ms.append(1000 * (event["_t"] - barged))
            return


@dataclass(frozen=True)
class SessionPlan:
    """What every session of a level is given: where to connect, the reference voice, how long to run,
    the units per response, and how long to wait for any one event."""

    url: str
    ref_uri: str
    duration_s: float
    units: int
    timeout: float = 300.0


async def turn_session(plan: SessionPlan, result: SessionResult | None = None) -> SessionResult:
    """The turn lane for ``plan.duration_s``; ``result`` (filled as the session goes) lets a caller that
    gives up on the session keep what it measured."""
    result = result or SessionResult("turn")
    timeout = plan.timeout
    client = await _open(plan.url, _session(plan.ref_uri, {"max_response_units": plan.units}))
    end = time.monotonic() + plan.duration_s
    try:
        while True:
            for barge_at in (None, 1):
                await client.stream(2.0, speech=True)
                sent = time.monotonic()
                await client.send({"type": "input_audio_buffer.commit", "response_create": True})
                await _response(client, result, sent, barge_at, timeout)
            if time.monotonic() >= end:
                break
        await _close(client)
    finally:
        await client.ws.close()
    return result


async def native_session(plan: SessionPlan, result: SessionResult | None = None) -> SessionResult:
    """The native lane for ``plan.duration_s`` (``result`` as for :func:`turn_session`)."""
    result = result or SessionResult("native")
    timeout = plan.timeout
    extra = {"auto_response": True, "force_listen_count": 0, "max_response_units": plan.units}
    client = await _open(plan.url, _session(plan.ref_uri, extra))
    active: dict[str, ResponseClock] = {}
    streaming = True

    async def follow() -> None:
        """Every response the model opens, until the input is over and none is active (``timeout`` bounds
        the whole wait after the final commit, from the caller)."""
        while streaming or active:
            try:
                event = await client.next(1.0)
            except TimeoutError:
                continue
            kind, rid = event["type"], event.get("response_id")
            if kind == "error":
                result.errors.append(event["error"])
            elif kind == "response.created":
                active[rid] = ResponseClock(started=event["_t"])
                result.responses.append(active[rid])
            elif kind == "response.output_audio.delta" and rid in active:
                active[rid].on_delta(event["_t"], len(base64.b64decode(event["delta"])))
            elif kind == "response.done" and rid in active:
                active.pop(rid).status = event["response"]["status"]

    follower = asyncio.create_task(follow())
    try:
        end = time.monotonic() + plan.duration_s
        while time.monotonic() < end and not follower.done():
            await client.stream(2.0, speech=True)
            await client.stream(4.0, speech=False)
        await client.send({"type": "input_audio_buffer.commit", "final": True})
        streaming = False
        await asyncio.wait_for(follower, timeout)
        await _close(client)
    finally:
        follower.cancel()
        await client.ws.close()
    return result


async def _close(client: Client) -> None:
    await client.send({"type": "session.close"})
    while (await client.next(60))["type"] != "session.closed":
        pass
