"""Cancellation latency: how fast a client disconnect releases the work of every stage.

    python -m bench.cancel --checkpoint DIR --deploy-config configs/deploy/minicpmo_4_5.yaml --device cuda \\
        --requests 20 --out-dir results/cancel

Issue 6 asks that a client disconnect cancels every stage stream and brings each stage's in-flight
gauge back to zero, target ≤ 100 ms. This bench measures exactly that, from outside the processes:

1. launches the pipeline with :class:`bench.launch.Pipeline` (the launcher's own child plan, free ports,
   logs under ``OUT_DIR/logs``) and waits for the gateway's ``/health``;
2. per request (one at a time): waits until every stage is idle (``minicpmo_stage_in_flight`` and
   ``minicpmo_stage_streams_active`` both 0 on each stage's Prometheus endpoint, grpc port + 1000 unless
   the stage was started with ``--metrics-port``), sends a streaming text+audio chat request whose speech
   is forced long (the same per-stage overrides as :mod:`bench.e2e`; default 1500 codec frames = 60 s of
   audio), and closes the HTTP connection right after the first audio chunk arrives;
3. from the moment the connection is closed, polls every stage's metrics endpoint every
   ``--poll-ms`` (5) ms, concurrently, until both gauges read 0 on each of them. A stage's release time
   is when the first poll that read zero *completed* (an upper bound; the poll period and the scrape
   time are reported next to the numbers). ``busy`` says whether the stage's gauges were non-zero on the
   first poll; a stage that had already finished its part (the thinker, with a short spoken span)
   releases "immediately" and is reported as such;
4. writes ``cancel.json`` (every request, per-stage and overall percentiles) and ``cancel.md``;
   always stops the pipeline (success, failure, Ctrl-C, SIGTERM, ``--max-seconds``).

Overall release = the slowest stage of the request. ``--warmup`` (1) untimed cycles come first so
one-off costs (CUDA graph capture, the default voice's prompt features) are not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chat_workload import add_workload_flags, make_prompts, request_body, workload_from_args
from bench.e2e_client import percentiles
from bench.launch import (
    Pipeline,
    add_launch_flags,
    environment,
    guarded_run,
    resolve_profile,
    stage_args_for,
)

TARGET_MS = 100.0
GAUGES = ("minicpmo_stage_in_flight", "minicpmo_stage_streams_active")
_SAMPLE = re.compile(r"^(minicpmo_stage_in_flight|minicpmo_stage_streams_active)(?:\{[^}]*\})?\s+(\S+)", re.M)


@dataclass
class StageEndpoint:
    name: str  # launcher child name, e.g. "talker-0"
    stage: str
    metrics_url: str


@dataclass
class CancelResult:
    ok: bool
    ttfp_ms: float | None = None
    release_ms: dict[str, float] = field(default_factory=dict)  # stage child -> ms after the disconnect
    busy: dict[str, bool] = field(default_factory=dict)  # gauges non-zero on the first poll
    first_poll: dict[str, dict[str, float]] = field(default_factory=dict)
    overall_ms: float | None = None
    polls: int = 0
    error: str = ""


def parse_gauges(text: str) -> dict[str, float]:
    """Sum of each watched gauge over its label sets in a Prometheus text exposition."""
    out = dict.fromkeys(GAUGES, 0.0)
    for name, value in _SAMPLE.findall(text):
        out[name] += float(value)
    return out


def stage_endpoints(pipeline: Pipeline) -> list[StageEndpoint]:
    """Every stage replica's metrics URL: ``--metrics-port`` from its argv, else grpc port + 1000."""
    eps: list[StageEndpoint] = []
    for child in pipeline.children:
        if child.stage is None:
            continue
        port = child.port + 1000
        if "--metrics-port" in child.argv:
            port = int(child.argv[child.argv.index("--metrics-port") + 1])
        eps.append(StageEndpoint(child.name, child.stage, f"http://127.0.0.1:{port}/metrics"))
    return eps


async def scrape(client: Any, eps: list[StageEndpoint]) -> dict[str, dict[str, float]]:
    resps = await asyncio.gather(*(client.get(ep.metrics_url, timeout=5.0) for ep in eps))
    return {ep.name: parse_gauges(r.text) for ep, r in zip(eps, resps, strict=True)}


def _idle(g: dict[str, float]) -> bool:
    return all(v == 0 for v in g.values())


async def wait_idle(client: Any, eps: list[StageEndpoint], timeout: float) -> None:
    t_end = time.monotonic() + timeout
    while True:
        state = await scrape(client, eps)
        if all(_idle(g) for g in state.values()):
            return
        if time.monotonic() > t_end:
            raise TimeoutError(f"stages not idle before the request after {timeout:.0f} s: {state}")
        await asyncio.sleep(0.05)


async def cancel_once(
    client: Any, url: str, body: dict[str, Any], eps: list[StageEndpoint], args: argparse.Namespace
) -> CancelResult:
    """One request: stream until the first audio chunk, close the connection, poll until released."""
    res = CancelResult(ok=False)
    await wait_idle(client, eps, args.release_timeout)
    t_send = time.perf_counter()
    try:
        # A fresh client per request: closing its connection mid-stream is the disconnect.
        async with httpx_client() as http:
            req = http.build_request("POST", url + "/v1/chat/completions", json=body)
            resp = await http.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:] == "[DONE]":
                        res.error = "stream ended before any audio chunk"
                        return res
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:300]
                        return res
                    if chunk.get("modality") == "audio" and any(
                        (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])
                    ):
                        res.ttfp_ms = (time.perf_counter() - t_send) * 1000
                        break
            finally:
                await resp.aclose()
    except Exception as exc:  # noqa: BLE001 - any transport error fails this request, not the run
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if res.ttfp_ms is None:
        res.error = res.error or "no audio chunk"
        return res
    t_disc = time.perf_counter()  # the client's socket is closed once the async-with above has exited
    pending = {ep.name for ep in eps}
    t_end = t_disc + args.release_timeout
    while pending:
        state = await scrape(client, eps)
        now = time.perf_counter()
        res.polls += 1
        if res.polls == 1:
            res.first_poll = state
            res.busy = {name: not _idle(g) for name, g in state.items()}
        for name in list(pending):
            if _idle(state[name]):
                res.release_ms[name] = (now - t_disc) * 1000
                pending.discard(name)
        if not pending:
            break
        if now > t_end:
            res.error = f"not released after {args.release_timeout:.0f} s: {sorted(pending)}"
            return res
        await asyncio.sleep(args.poll_ms / 1000)
    res.overall_ms = max(res.release_ms.values())
    res.ok = True
    return res


def httpx_client() -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))


async def drive(
    args: argparse.Namespace,
    url: str,
    bodies: list[dict[str, Any]],
    eps: list[StageEndpoint],
    deadline: float,
) -> tuple[list[CancelResult], dict[str, float]]:
    import httpx

    results: list[CancelResult] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=len(eps) + 2)) as client:
        # Scrape cost: what one poll of every endpoint takes (bounds the timing resolution).
        scrape_ms: list[float] = []
        for _ in range(20):
            t0 = time.perf_counter()
            await scrape(client, eps)
            scrape_ms.append((time.perf_counter() - t0) * 1000)
        for i in range(args.warmup):
            r = await cancel_once(client, url, bodies[-1 - i], eps, args)
            print(
                f"[cancel] warm-up {i + 1}/{args.warmup}: {'ok' if r.ok else 'FAILED ' + r.error}", flush=True
            )
        for i in range(args.requests):
            if time.monotonic() >= deadline:
                print(f"[cancel] out of time after {i} request(s)", flush=True)
                break
            r = await cancel_once(client, url, bodies[i], eps, args)
            results.append(r)
            if r.ok:
                per = ", ".join(
                    f"{n} {ms:.1f}{'' if r.busy[n] else ' (idle)'}" for n, ms in r.release_ms.items()
                )
                print(
                    f"[cancel] {i + 1}/{args.requests}: TTFP {r.ttfp_ms:.0f} ms; released after "
                    f"{r.overall_ms:.1f} ms ({per}; {r.polls} polls)",
                    flush=True,
                )
            else:
                print(f"[cancel] {i + 1}/{args.requests}: FAILED {r.error}", flush=True)
    return results, percentiles(scrape_ms)


def summarize(results: list[CancelResult], eps: list[StageEndpoint]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    per_stage = {}
    for ep in eps:
        vals = [r.release_ms[ep.name] for r in ok]
        busy = [r.release_ms[ep.name] for r in ok if r.busy.get(ep.name)]
        per_stage[ep.name] = {**percentiles(vals), "busy_count": len(busy), "busy": percentiles(busy)}
    return {
        "per_stage_ms": per_stage,
        "overall_ms": percentiles([r.overall_ms for r in ok if r.overall_ms is not None]),
    }


def render_markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    s = report["summary"]
    lines = [
        f"## Cancellation latency — profile `{report['profile']}`, {report['device_note']}",
        "",
        f"{report['completed']}/{report['requests']} streaming text+audio requests, one at a time; forced "
        f"{w['audio_frames']} codec frames ({w['audio_seconds']:.0f} s of audio), {w['spoken_tokens']} spoken "
        f"tokens, {w['prompt_tokens']}-token prompts. The client closes the connection after the first audio "
        f"chunk; every stage's `minicpmo_stage_in_flight` and `minicpmo_stage_streams_active` are polled "
        f"every {report['poll_ms']:.0f} ms (one scrape of all endpoints: p50 "
        f"{report['scrape_ms'].get('p50', float('nan')):.1f} ms) until both read 0. "
        "Times are ms from the disconnect to the first poll that read zero (upper bound).",
        "",
        "| stage | busy at disconnect | p50 ms | p90 ms | max ms |",
        "|---|---|---|---|---|",
    ]
    for name, m in s["per_stage_ms"].items():
        if m.get("p50") is not None:
            lines.append(
                f"| {name} | {m['busy_count']}/{report['completed']} | {m['p50']:.1f} | {m['p90']:.1f} "
                f"| {m['max']:.1f} |"
            )
    o = s["overall_ms"]
    if o:
        lines.append(f"| **all stages** | | {o['p50']:.1f} | {o['p90']:.1f} | {o['max']:.1f} |")
    lines += ["", f"- {report['verdict']}"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cancel", description=__doc__.split("\n\n")[0])
    add_launch_flags(p)
    p.add_argument("--requests", type=int, default=20, help="timed disconnect cycles (sequential)")
    p.add_argument("--warmup", type=int, default=1, help="untimed disconnect cycles first")
    add_workload_flags(
        p, 1500, "forced talker frames (25 per second of audio); long so the work outlives the disconnect"
    )
    p.add_argument("--poll-ms", type=float, default=5.0)
    p.add_argument(
        "--release-timeout", type=float, default=30.0, help="seconds to wait for the gauges to reach 0"
    )
    p.add_argument(
        "--max-seconds", type=float, default=480.0, help="no new request after this (teardown follows)"
    )
    p.add_argument("--out-dir", default=None, help="default: $OUT/cancel or ./bench-results/cancel")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.max_seconds
    args.levels = [1]  # resolve_profile raises the gateway's admission limit to this + 2
    w = workload_from_args(args)
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "cancel")
    out_dir.mkdir(parents=True, exist_ok=True)

    from services.common.checkpoint import Checkpoint

    checkpoint = Path(args.checkpoint)
    profile = resolve_profile(args, w)
    stage_args = stage_args_for(args, profile)
    print(f"[cancel] building {args.requests + args.warmup} prompts of {w.prompt_tokens} tokens", flush=True)
    prompts = make_prompts(Checkpoint(checkpoint).tokenizer(), args.requests + args.warmup, w.prompt_tokens)
    bodies = [request_body(p, w, profile.served_model_name) for p in prompts]
    devices = sorted({d for s in ("thinker", "talker", "code2wav") for d in profile.stage(s).devices})
    report: dict[str, Any] = {
        "bench": "cancel",
        "profile": profile.name,
        "profile_source": profile.source,
        "device_note": "devices " + ", ".join(devices),
        "checkpoint": str(checkpoint.resolve()),
        "workload": {**asdict(w), "audio_seconds": w.audio_seconds},
        "requests": args.requests,
        "warmup": args.warmup,
        "poll_ms": args.poll_ms,
        "release_timeout_s": args.release_timeout,
        "target_ms": TARGET_MS,
        "gauges": list(GAUGES),
        "environment": environment(),
        "status": "started",
    }
    results: list[CancelResult] = []
    eps: list[StageEndpoint] = []
    with guarded_run(report, "cancel") as run:
        pipeline = Pipeline(profile, checkpoint, out_dir / "logs", stage_args)
        run.teardown.append(pipeline.stop)
        eps = stage_endpoints(pipeline)
        report["metrics_urls"] = {ep.name: ep.metrics_url for ep in eps}
        pipeline.start()
        budget = min(args.startup_timeout, max(1.0, deadline - time.monotonic()))
        report["startup_s"] = pipeline.wait_healthy(budget)
        print(
            f"[cancel] pipeline healthy after {report['startup_s']:.1f} s; watching "
            f"{', '.join(ep.metrics_url for ep in eps)}",
            flush=True,
        )
        results, report["scrape_ms"] = asyncio.run(drive(args, pipeline.url, bodies, eps, deadline))
        failed = [r for r in results if not r.ok]
        report["status"] = (
            "ok" if len(results) == args.requests and not failed else ("failures" if failed else "incomplete")
        )
    rc = run.rc
    report.setdefault("scrape_ms", {})
    report["completed"] = sum(r.ok for r in results)
    report["all_released"] = bool(results) and all(r.ok for r in results)
    report["summary"] = summarize(results, eps)
    report["results"] = [asdict(r) for r in results]
    overall = report["summary"]["overall_ms"]
    if overall:
        ok = overall["max"] <= TARGET_MS
        report["verdict"] = (
            f"all stages released within {overall['max']:.1f} ms max (p50 {overall['p50']:.1f}); "
            f"{'meets' if ok else 'misses'} the {TARGET_MS:.0f} ms target"
        )
    else:
        report["verdict"] = "nothing measured"
    report["wall_s"] = time.monotonic() - t_start
    (out_dir / "cancel.json").write_text(json.dumps(report, indent=2))
    md = render_markdown(report)
    (out_dir / "cancel.md").write_text(md)
    print(md, flush=True)
    print(
        f"[cancel] status: {report['status']}; wrote {out_dir / 'cancel.json'} and {out_dir / 'cancel.md'}",
        flush=True,
    )
    if rc == 0 and report["status"] != "ok":
        rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
