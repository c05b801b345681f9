"""Realtime duplex load: N concurrent sessions against a running gateway, with a barge-in in each.

    python -m bench.realtime_duplex --url ws://127.0.0.1:8099 --sessions 1 4 8 --ref-audio voice.wav \
        [--http-url http://127.0.0.1:8099] [--units 4] [--out results.json]

Per session (turn lane, so a random-weight model answers too): commit 2 s of audio, ``response.create``,
barge in at the first audio delta, commit again, ``response.create``, wait for ``response.done``, close.
Reported per concurrency level (p50/p90):

* ``first_audio_s`` — ``response.create`` to the first audio delta;
* ``barge_in_ms`` — ``barge_in`` sent to the cancelled ``response.done`` (client side, includes one
  socket round trip; the gateway's own histogram is ``minicpmo_realtime_barge_in_seconds``);
* ``audio_rtf`` — wall time from the first to the last audio delta of the second response divided by
  the audio duration it carried;
* from the gateway's ``/metrics`` (deltas over the run): mean unit decision time
  (``minicpmo_realtime_unit_decision_seconds``), its real-time factor (÷ 1 s), and the mean per-stage
  interrupt-ack latency (``minicpmo_realtime_stage_interrupt_ack_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np


def _pcm_b64(seconds: float) -> str:
    t = np.arange(int(seconds * 16000)) / 16000
    return base64.b64encode((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()).decode()


def _scrape(http_url: str | None) -> dict[str, float]:
    if not http_url:
        return {}
    text = urllib.request.urlopen(f"{http_url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(minicpmo_realtime_[a-z_]+(?:_sum|_count))(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def one_session(url: str, ref_uri: str, units: int) -> dict[str, float]:
    import websockets

    async with websockets.connect(f"{url}/v1/realtime?duplex=1&autostart=0", max_size=None) as ws:
        async def until(pred: Any) -> dict[str, Any]:
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "error":
                    raise RuntimeError(event["error"])
                if pred(event):
                    return event

        await ws.send(json.dumps({"type": "session.update", "session": {
            "modalities": ["audio", "text"], "ref_audio": ref_uri, "turn_detection": None,
            "extra_body": {"max_response_units": units}}}))
        await until(lambda e: e["type"] == "session.updated")
        res: dict[str, float] = {}
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _pcm_b64(2.0)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        t0 = time.monotonic()
        await ws.send(json.dumps({"type": "response.create"}))
        await until(lambda e: e["type"] == "response.output_audio.delta")
        res["first_audio_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        await ws.send(json.dumps({"type": "barge_in"}))
        await until(lambda e: e["type"] == "response.done")
        res["barge_in_ms"] = 1000 * (time.monotonic() - t1)
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _pcm_b64(2.0)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "response_create": True}))
        first = last = None
        audio_ms = 0
        while True:
            event = await until(lambda e: e["type"] in ("response.output_audio.delta", "response.done"))
            if event["type"] == "response.done":
                break
            now = time.monotonic()
            first = first or now
            last = now
            audio_ms = event["metadata"]["audio_duration_ms"]
        if first is not None and last is not None and audio_ms:
            res["audio_rtf"] = (last - first) / (audio_ms / 1000)
        await ws.send(json.dumps({"type": "session.close"}))
        await until(lambda e: e["type"] == "session.closed")
        return res


def _pct(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)), "n": len(values)}


async def run_level(args: argparse.Namespace, n: int, ref_uri: str) -> dict[str, Any]:
    before = _scrape(args.http_url)
    results = await asyncio.gather(*(one_session(args.url, ref_uri, args.units) for _ in range(n)))
    after = _scrape(args.http_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    level: dict[str, Any] = {"sessions": n}
    for key in ("first_audio_s", "barge_in_ms", "audio_rtf"):
        level[key] = _pct([r[key] for r in results if key in r])
    count = delta.get("minicpmo_realtime_unit_decision_seconds_count", 0.0)
    if count:
        mean = delta["minicpmo_realtime_unit_decision_seconds_sum"] / count
        level["unit_decision_mean_s"] = mean
        level["unit_decision_rtf"] = mean / 1.0
    for stage in ("thinker", "talker", "code2wav"):
        key = f'minicpmo_realtime_stage_interrupt_ack_seconds_count{{stage="{stage}"}}'
        if delta.get(key):
            total = delta[f'minicpmo_realtime_stage_interrupt_ack_seconds_sum{{stage="{stage}"}}']
            level[f"{stage}_interrupt_ack_mean_ms"] = 1000 * total / delta[key]
    return level


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8099")
    p.add_argument("--http-url", default=None, help="gateway HTTP base for /metrics (optional)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--units", type=int, default=4, help="max units per response")
    p.add_argument("--ref-audio", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ref_uri = "data:audio/wav;base64," + base64.b64encode(Path(args.ref_audio).read_bytes()).decode()
    levels = [asyncio.run(run_level(args, n, ref_uri)) for n in args.sessions]
    text = json.dumps({"levels": levels}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
