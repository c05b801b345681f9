"""Realtime duplex load: N concurrent sessions, with a barge-in in each (issue 7's benchmark).

    python -m bench.realtime_duplex --checkpoint CKPT [--deploy-config minicpmo_4_5] [--device cuda] \
        [--sessions 1 4 8] [--out-dir DIR]          # launches the pipeline itself (bench/all 'realtime')
    python -m bench.realtime_duplex --url ws://127.0.0.1:8099 --ref-audio voice.wav \
        [--http-url http://127.0.0.1:8099] [--units 4] [--out results.json]   # against a running gateway

Per session (turn lane, so a random-weight model answers too): commit 2 s of audio, ``response.create``,
barge in at the first audio delta, commit again, ``response.create``, wait for ``response.done``, close.
Reported per concurrency level (p50/p90):

* ``first_audio_s`` — ``response.create`` to the first audio delta;
* ``barge_in_ms`` — ``barge_in`` sent to the cancelled ``response.done`` (client side, includes one
  socket round trip; the gateway's own histogram is ``minicpmo_realtime_barge_in_seconds``);
* ``audio_rtf`` — wall time from the first to the last audio delta of the second response divided by
  the audio duration it carried;
* from the gateway's ``/metrics`` (deltas over the run): mean unit decision time
  (``minicpmo_realtime_unit_decision_seconds``), its real-time factor (÷ 1 s), the mean per-stage
  interrupt-ack latency (``minicpmo_realtime_stage_interrupt_ack_seconds``) and the gateway barge-in
  latency (``minicpmo_realtime_barge_in_seconds``: barge_in received -> cancelled response.done, after
  which no audio of it is sent);
* from each stage's own ``/metrics`` (launch mode): the stage-side barge-in latency
  ``minicpmo_stage_interrupt_drain_seconds`` (interrupt received -> last engine step of the old epoch).

Per-unit processing time is reported as the thinker's unit decision time plus the talker + code2wav time
for one second of audio (``audio_rtf`` x 1 s); the target is a unit real-time factor <= 0.25 at 4 sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.e2e_client import histogram_sums


def _pcm_b64(seconds: float) -> str:
    t = np.arange(int(seconds * 16000)) / 16000
    return base64.b64encode((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()).decode()


# Stage histograms read per level: the barge-in drain of every stage, and the thinker's split of a duplex
# unit (queued / encode / engine) and of an engine step (forward / sample).
STAGE_PREFIXES = "(?:minicpmo_stage_interrupt_drain_|minicpmo_thinker_duplex_unit_|minicpmo_thinker_step_phase_)"


def _scrape(http_url: str | None, stage_urls: list[str] | None = None) -> dict[str, float]:
    """Histogram sums/counts of the gateway (minicpmo_realtime_*) and the stages' drain histogram."""
    out: dict[str, float] = {}
    if http_url:
        out.update(histogram_sums(f"{http_url}/metrics", "minicpmo_realtime_"))
    for url in stage_urls or []:
        for k, v in histogram_sums(url, STAGE_PREFIXES).items():
            out[k] = out.get(k, 0.0) + v
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


async def run_level(args: argparse.Namespace, n: int, ref_uri: str,
                    stage_urls: list[str] | None = None) -> dict[str, Any]:
    before = _scrape(args.http_url, stage_urls)
    results = await asyncio.gather(*(one_session(args.url, ref_uri, args.units) for _ in range(n)),
                                   return_exceptions=True)
    after = _scrape(args.http_url, stage_urls)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok = [r for r in results if isinstance(r, dict)]
    level: dict[str, Any] = {"sessions": n, "failed": len(results) - len(ok),
                             "errors": [repr(r)[:300] for r in results if not isinstance(r, dict)]}
    for key in ("first_audio_s", "barge_in_ms", "audio_rtf"):
        level[key] = _pct([r[key] for r in ok if key in r])

    def mean_ms(name: str) -> float | None:
        count = delta.get(name.replace("{", "_count{", 1) if "{" in name else name + "_count", 0.0)
        if not count:
            return None
        total = delta[name.replace("{", "_sum{", 1) if "{" in name else name + "_sum"]
        return 1000 * total / count

    decision = mean_ms("minicpmo_realtime_unit_decision_seconds")
    if decision is not None:
        level["unit_decision_mean_ms"] = decision
        if level["audio_rtf"]:
            level["unit_processing_ms"] = decision + 1000 * level["audio_rtf"]["p50"]
            level["unit_rtf"] = level["unit_processing_ms"] / 1000
    level["gateway_barge_in_mean_ms"] = mean_ms("minicpmo_realtime_barge_in_seconds")
    for stage in ("thinker", "talker", "code2wav"):
        level[f"{stage}_interrupt_ack_mean_ms"] = mean_ms(
            f'minicpmo_realtime_stage_interrupt_ack_seconds{{stage="{stage}"}}')
        level[f"{stage}_drain_mean_ms"] = mean_ms(f'minicpmo_stage_interrupt_drain_seconds{{stage="{stage}"}}')
    for phase in ("queued", "encode", "engine"):
        level[f"thinker_unit_{phase}_mean_ms"] = mean_ms(
            f'minicpmo_thinker_duplex_unit_seconds{{phase="{phase}"}}')
    for phase in ("forward", "sample"):
        level[f"thinker_step_{phase}_mean_ms"] = mean_ms(
            f'minicpmo_thinker_step_phase_seconds{{phase="{phase}"}}')
    return level


def render_markdown(levels: list[dict[str, Any]]) -> str:
    def f(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = ["| sessions | failed | first audio p50 ms | unit decision ms | audio RTF p50 | unit RTF | "
             "barge-in client p50 ms | gateway ms | stage drain ms thinker / talker / code2wav | "
             "thinker unit ms queued / encode / engine | thinker step ms forward / sample |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        fa = lv["first_audio_s"]["p50"] * 1000 if lv["first_audio_s"] else None
        rtf = lv["audio_rtf"]["p50"] if lv["audio_rtf"] else None
        bi = lv["barge_in_ms"]["p50"] if lv["barge_in_ms"] else None
        drains = " / ".join(f(lv.get(f"{s}_drain_mean_ms"), 2) for s in ("thinker", "talker", "code2wav"))
        unit = " / ".join(f(lv.get(f"thinker_unit_{p}_mean_ms")) for p in ("queued", "encode", "engine"))
        step = " / ".join(f(lv.get(f"thinker_step_{p}_mean_ms"), 2) for p in ("forward", "sample"))
        lines.append(f"| {lv['sessions']} | {lv['failed']} | {f(fa)} | {f(lv.get('unit_decision_mean_ms'))} | "
                     f"{f(rtf, 3)} | {f(lv.get('unit_rtf'), 3)} | {f(bi)} | "
                     f"{f(lv.get('gateway_barge_in_mean_ms'), 2)} | {drains} | {unit} | {step} |")
    return "\n".join(lines) + "\n"


def _launch(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """Start the pipeline for ``--checkpoint`` with the profile; point the bench at it."""
    from bench.cancel import stage_endpoints
    from bench.e2e import MpsDaemon, Pipeline
    from services.common.checkpoint import Checkpoint
    from services.common.deploy_profile import load_profile, parse_overrides

    profile = load_profile(args.deploy_config).with_device(args.device)
    if args.stage_overrides:
        profile = profile.with_overrides(parse_overrides(args.stage_overrides))
    out = Path(args.out_dir or ".")
    if args.mps:
        args.mps_daemon = MpsDaemon(Path(tempfile.mkdtemp(prefix="minicpmo-mps-")))
        args.mps_daemon.start()  # the stages launched next inherit its environment: MPS clients
    pipeline = Pipeline(profile, Path(args.checkpoint), out / "logs", {})
    pipeline.start()
    try:
        took = pipeline.wait_healthy(args.startup_timeout)
    except BaseException:
        pipeline.stop()
        if args.mps:
            args.mps_daemon.stop()
        raise
    print(f"[realtime] pipeline healthy after {took:.1f} s at {pipeline.url}", flush=True)
    args.url = pipeline.url.replace("http://", "ws://")
    args.http_url = pipeline.url
    if not args.ref_audio:
        args.ref_audio = str(Checkpoint(args.checkpoint).ref_audio_path)
    return pipeline, [ep.metrics_url for ep in stage_endpoints(pipeline)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8099")
    p.add_argument("--http-url", default=None, help="gateway HTTP base for /metrics (optional)")
    p.add_argument("--checkpoint", default=None, help="launch the pipeline on this checkpoint (launch mode)")
    p.add_argument("--deploy-config", default="minicpmo_4_5")
    p.add_argument("--device", default="cuda")
    p.add_argument("--stage-overrides", default=None, help="JSON, as minicpmo-serve takes it")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--units", type=int, default=4, help="max units per response")
    p.add_argument("--warmup", type=int, default=1,
                   help="sessions run once, unmeasured, before the first level (CUDA-graph shapes, allocator)")
    p.add_argument("--ref-audio", default=None, help="voice WAV (default: the checkpoint's, in launch mode)")
    p.add_argument("--mps", action="store_true",
                   help="launch mode: the stages run as clients of a private MPS daemon (default: time-slicing)")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--out-dir", default=None, help="directory for realtime.json, realtime.md and logs")
    args = p.parse_args(argv)
    if args.mps and not args.checkpoint:
        p.error("--mps needs --checkpoint (it launches the stages itself)")
    pipeline = None
    stage_urls: list[str] = []
    if args.checkpoint:
        pipeline, stage_urls = _launch(args)
    elif not args.ref_audio:
        p.error("--ref-audio is required without --checkpoint")
    try:
        ref_uri = "data:audio/wav;base64," + base64.b64encode(Path(args.ref_audio).read_bytes()).decode()
        if args.warmup > 0:
            print(f"[realtime] warm-up: {args.warmup} session(s)", flush=True)
            warm = asyncio.run(run_level(args, args.warmup, ref_uri, stage_urls))
            if warm["failed"]:
                print(f"[realtime] warm-up failures: {warm['errors']}", flush=True)
        levels = []
        for n in args.sessions:
            print(f"[realtime] {n} concurrent session(s)", flush=True)
            levels.append(asyncio.run(run_level(args, n, ref_uri, stage_urls)))
    finally:
        if pipeline is not None:
            pipeline.stop()
        if getattr(args, "mps_daemon", None) is not None:
            args.mps_daemon.stop()
    sharing = "MPS" if args.mps else "separate processes time-slicing" if args.checkpoint else "external"
    text = json.dumps({"gpu_sharing": sharing, "levels": levels}, indent=2)
    md = render_markdown(levels)
    print(text)
    print(md, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "realtime.json").write_text(text)
        (Path(args.out_dir) / "realtime.md").write_text(md)
    return 1 if any(lv["failed"] for lv in levels) else 0


if __name__ == "__main__":
    raise SystemExit(main())
