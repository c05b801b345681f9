"""Benchmark of the audio API: ``/v1/audio/speech`` latency and real-time factor, default voice vs a
registered voice, and ``/v1/audio/transcriptions`` of a 60 s clip. Launches the pipeline, measures, tears
it down.

    python -m bench.audio_speech --checkpoint DIR --deploy-config minicpmo_4_5 --device cuda \\
        --out-dir results/audio

What it measures (each request is a distinct ``--words``-word input, 20 by default, ``response_format:
pcm``, streamed):

* TTFB: seconds from sending the request to the first audio byte, at c=1 and at c=8 (``--requests``
  requests per level, at most c in flight, after ``--warmup`` rounds of c requests);
* RTF: the request's total time / the seconds of audio it returned, at c=1 and c=8; and the stream RTF,
  (total - TTFB) / audio seconds: the rate at which audio came once it started, without the first-byte
  latency that dominates the RTF of a short input;
* the same levels with a registered voice: the checkpoint's default reference clip uploaded once to
  ``POST /v1/audio/voices`` (so both runs speak with the same voice; the registered one sends stored
  code2wav features, and the thinker gets the clip's stored rows in its speech system prompt);
  ``--interleave`` runs both voices in the same levels instead, alternating request by request, so
  both see the same load (reported per voice);
* per level, where the time went in each stage (:mod:`bench.stage_profile`, from the stages' Prometheus
  metrics scraped before and after the level): busy seconds / wall seconds, steps, mean batch, code2wav's
  per-step RTF histogram, and the thinker prefill tokens, talker frames and audio each request cost;
* transcription: a 60 s clip (the reference clip repeated with 0.4 s pauses) at c=1, seconds per request,
  with the same stage profile.

Targets (issue text): TTFB <= 120 ms at c=1, p90 <= 250 ms at c=8, RTF <= 0.05 at c=8, registered voice
no slower than the default, 60 s transcription <= 1.5 s. Writes ``audio.json`` and ``audio.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import stage_profile
from bench.e2e_client import percentiles
from bench.launch import (
    Pipeline,
    add_launch_flags,
    environment,
    guarded_run,
    stage_args_for,
    with_gpu_sharing,
)
from services.common.deploy_profile import load_profile, parse_overrides

MODEL = "openbmb/MiniCPM-o-4_5"
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright birds sing softly near an old "
    "stone bridge beside the quiet river"
).split()


def words_input(i: int, n: int = 20) -> str:
    """A distinct ``n``-word sentence (request ``i``): the word list rotated by ``i``, ending in ``i``."""
    rot = i % len(WORDS)
    ring = WORDS[rot:] + WORDS[:rot]
    words = [ring[k % len(ring)] for k in range(max(1, n - 1))]
    return " ".join(words).capitalize() + f" {i}."


async def one_speech(client: Any, url: str, i: int, voice: str, words: int = 20) -> dict[str, Any]:
    body = {"model": MODEL, "input": words_input(i, words), "voice": voice, "response_format": "pcm"}
    t0 = time.perf_counter()
    first = None
    size = 0
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"speech {r.status_code}: {(await r.aread())[:300]!r}")
        async for chunk in r.aiter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - t0
            size += len(chunk)
    total = time.perf_counter() - t0
    audio_s = size / 2 / 24000
    ttfb = first or total
    return {
        "voice": voice,
        "ttfb_s": ttfb,
        "total_s": total,
        "audio_s": audio_s,
        "rtf": total / max(audio_s, 1e-9),
        "stream_rtf": (total - ttfb) / max(audio_s, 1e-9),
    }


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "requests": len(results),
        "ttfb_s": percentiles([r["ttfb_s"] for r in results]),
        "rtf": percentiles([r["rtf"] for r in results]),
        "stream_rtf": percentiles([r["stream_rtf"] for r in results]),
        "audio_s": percentiles([r["audio_s"] for r in results]),
    }


async def speech_level(
    url: str,
    concurrency: int,
    requests: int,
    warmup: int,
    voices: list[str],
    base: int,
    words: int = 20,
    endpoints: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One level: ``requests`` requests at most ``concurrency`` in flight, request ``i`` in voice
    ``voices[i % len(voices)]``; the stages' metrics are scraped around the measured requests."""
    import httpx

    def voice_of(i: int) -> str:
        return voices[i % len(voices)]

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        for w in range(warmup):
            await asyncio.gather(
                *(
                    one_speech(client, url, base + 10_000 + w * 64 + k, voice_of(k), words)
                    for k in range(concurrency)
                )
            )
        gate = asyncio.Semaphore(concurrency)

        async def run(i: int) -> dict[str, Any]:
            async with gate:
                return await one_speech(client, url, base + i, voice_of(i), words)

        before = await asyncio.to_thread(stage_profile.scrape, endpoints or {})
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - t0
        after = await asyncio.to_thread(stage_profile.scrape, endpoints or {})
    level: dict[str, Any] = {
        "voice": "+".join(voices),
        "concurrency": concurrency,
        "wall_s": wall,
        **_summary(results),
        "audio_s_per_wall_s": sum(r["audio_s"] for r in results) / wall if wall > 0 else 0.0,
        "results": results,
        "profile": stage_profile.level_profile(before, after, wall, requests),
    }
    if len(voices) > 1:
        level["by_voice"] = {v: _summary([r for r in results if r["voice"] == v]) for v in voices}
    return level


def sixty_second_clip(ref: Path) -> bytes:
    import soundfile as sf

    from services.common.audio import read_audio

    samples, rate = read_audio(ref)
    pause = np.zeros(int(0.4 * rate), np.float32)
    pieces: list[np.ndarray] = []
    while sum(p.size for p in pieces) < 60 * rate:
        pieces += [samples, pause]
    clip = np.concatenate(pieces)[: 60 * rate]
    buf = io.BytesIO()
    sf.write(buf, clip, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def transcription_level(
    url: str, clip: bytes, requests: int, warmup: int, endpoints: dict[str, str] | None = None
) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient() as client:

        async def one() -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            r = await client.post(
                f"{url}/v1/audio/transcriptions",
                data={"model": MODEL, "response_format": "verbose_json"},
                files={"file": ("clip.wav", clip, "audio/wav")},
                timeout=300,
            )
            if r.status_code != 200:
                raise RuntimeError(f"transcription {r.status_code}: {r.text[:300]}")
            return time.perf_counter() - t0, r.json()

        for _ in range(warmup):
            await one()
        before = await asyncio.to_thread(stage_profile.scrape, endpoints or {})
        t0 = time.perf_counter()
        runs = [await one() for _ in range(requests)]
        wall = time.perf_counter() - t0
        after = await asyncio.to_thread(stage_profile.scrape, endpoints or {})
    segments = runs[-1][1].get("segments", []) if runs else []
    return {
        "clip_s": 60.0,
        "concurrency": 1,
        "requests": requests,
        "latency_s": percentiles([t for t, _ in runs]),
        "windows": [round(float(s["end"]) - float(s["start"]), 2) for s in segments],
        "profile": stage_profile.level_profile(before, after, wall, requests),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| voice | c | TTFB p50 ms | TTFB p90 ms | RTF mean | RTF p90 | stream RTF mean | audio s (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(voice: str, c: int, lv: dict[str, Any]) -> str:
        return (
            f"| {voice} | {c} | {1000 * lv['ttfb_s']['p50']:.0f} | {1000 * lv['ttfb_s']['p90']:.0f} "
            f"| {lv['rtf']['mean']:.3f} | {lv['rtf']['p90']:.3f} | {lv['stream_rtf']['mean']:.3f} "
            f"| {lv['audio_s']['mean']:.2f} |"
        )

    for lv in report.get("speech", []):
        if "by_voice" in lv:
            lines += [row(v, lv["concurrency"], s) for v, s in lv["by_voice"].items()]
        else:
            lines.append(row(lv["voice"], lv["concurrency"], lv))
    tr = report.get("transcription")
    if tr:
        lines += [
            "",
            f"60 s transcription at c=1: p50 {tr['latency_s']['p50']:.3f} s, p90 {tr['latency_s']['p90']:.3f} s"
            + (f" ({len(tr['windows'])} windows: {tr['windows']} s)" if tr.get("windows") else ""),
        ]
    lines += ["", "## Stage profile per level (bench/stage_profile.py)"]
    for lv in report.get("speech", []):
        if lv.get("profile", {}).get("stages"):
            lines += [
                "",
                f"### speech, voice {lv['voice']}, c={lv['concurrency']}: {lv['audio_s_per_wall_s']:.1f} s of "
                "audio per wall second",
                "",
                *stage_profile.markdown(lv["profile"]),
            ]
    if tr and tr.get("profile", {}).get("stages"):
        lines += ["", "### 60 s transcription, c=1", "", *stage_profile.markdown(tr["profile"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audio_speech", description=__doc__.splitlines()[0])
    add_launch_flags(p)
    p.add_argument("--out-dir", default="results/audio")
    p.add_argument("--requests", type=int, default=32, help="speech requests per level")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds (c requests each) before a level")
    p.add_argument("--levels", default="1,8", help="speech concurrency levels")
    p.add_argument("--transcriptions", type=int, default=5, help="60 s transcriptions at c=1 (0: skip)")
    p.add_argument("--words", type=int, default=20, help="words per speech input")
    p.add_argument(
        "--voices",
        default="default,bench",
        help="voices to measure, in order: 'default', 'bench' (the registered copy of the default clip)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run the voices in the same levels, alternating request by request (the same load for both)",
    )
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.deploy_config)
    if args.device:
        profile = profile.with_device(args.device)
    overrides = parse_overrides(args.stage_overrides)
    gateway = dict(overrides.get("gateway", {}))
    gateway["voice_dir"] = str((out / "voices").resolve())
    gateway["max_concurrent_requests"] = max(profile.gateway.max_concurrent_requests, max(levels) + 2)
    overrides["gateway"] = gateway
    profile = with_gpu_sharing(profile.with_overrides(overrides), args)
    report: dict[str, Any] = {
        "environment": environment(),
        "profile": profile.name,
        "status": "ok",
        "speech": [],
    }
    with guarded_run(report, "audio") as outcome:
        from services.common.checkpoint import Checkpoint

        ref = Checkpoint(args.checkpoint).ref_audio_path
        pipeline = Pipeline(profile, Path(args.checkpoint), out / "logs", stage_args_for(args, profile))
        outcome.teardown.append(pipeline.stop)
        pipeline.start()
        print(f"[audio] healthy after {pipeline.wait_healthy(args.startup_timeout):.1f} s", flush=True)
        import httpx

        httpx.delete(f"{pipeline.url}/v1/audio/voices/bench", timeout=30)
        created = httpx.post(
            f"{pipeline.url}/v1/audio/voices",
            data={"name": "bench"},
            files={"file": ("ref.wav", ref.read_bytes(), "audio/wav")},
            timeout=120,
        )
        if created.status_code != 200:
            raise RuntimeError(f"voice registration failed: {created.status_code} {created.text[:300]}")
        from bench.cancel import stage_endpoints

        endpoints = {ep.name: ep.metrics_url for ep in stage_endpoints(pipeline)}
        voices = [v.strip() for v in args.voices.split(",") if v.strip()]
        groups = [voices] if args.interleave else [[v] for v in voices]
        for group in groups:
            for c in levels:
                print(f"[audio] speech voice={'+'.join(group)} c={c}", flush=True)
                level = asyncio.run(
                    speech_level(
                        pipeline.url, c, args.requests, args.warmup, group, 1000 * c, args.words, endpoints
                    )
                )
                report["speech"].append(level)
                print(
                    f"[audio]   TTFB p50 {1000 * level['ttfb_s']['p50']:.0f} ms p90 {1000 * level['ttfb_s']['p90']:.0f} ms, "
                    f"RTF mean {level['rtf']['mean']:.3f} (stream {level['stream_rtf']['mean']:.3f})",
                    flush=True,
                )
        if args.transcriptions:
            print("[audio] transcription of a 60 s clip at c=1", flush=True)
            report["transcription"] = asyncio.run(
                transcription_level(pipeline.url, sixty_second_clip(ref), args.transcriptions, 1, endpoints)
            )
    (out / "audio.json").write_text(json.dumps(report, indent=1))
    (out / "audio.md").write_text(markdown(report))
    print(markdown(report))
    return outcome.rc


if __name__ == "__main__":
    sys.exit(main())
