"""End-to-end benchmark of the chat route: launch the pipeline, drive it per concurrency, tear it down.

    python -m bench.e2e --checkpoint DIR --deploy-config configs/deploy/minicpmo_4_5.yaml --device cuda \\
        --concurrency 1,4,8 --requests-per-level 32 --out-dir results/e2e

What it does, in order (each step prints progress; the whole run is bounded by ``--max-seconds``):

1. resolves the deploy profile (``--device`` forces every stage onto cpu/cuda, the workload's
   first-chunk size is applied as a profile override) and starts the three stage processes and the
   gateway with the launcher's own child plan (:func:`gateway.launcher.plan_children`) on free ports;
   with several stages on one GPU they share it as the profile's ``gpu_sharing`` says (MPS clients of a
   daemon private to this run, or time-slicing; ``--gpu-sharing`` overrides it);
2. waits for the gateway's ``/health`` (200 only when every stage answers its gRPC health check);
3. warms up (``--warmup`` requests at c=1, then ``--warmup-rounds`` × c requests before each level, so
   CUDA graphs of each batch size are captured before anything is timed);
4. per concurrency level sends ``--requests-per-level`` streaming requests with at most c in flight and
   records TTFT, TTFP, E2E, RTF per request (definitions in :mod:`bench.e2e_client`);
5. optionally sends ``--timeline-requests`` non-streaming requests at c=1 with ``return_stage_metrics``
   to record where the time goes inside the gateway (first text, first speech chunk, first codec
   window, first audio, last audio);
6. writes ``e2e.json`` (workload, environment, per-level percentiles, every request) and ``e2e.md``;
7. always stops the gateway and the stages (and the MPS daemon), on success, failure, Ctrl-C, SIGTERM
   (``timeout`` sends SIGTERM) or when ``--max-seconds`` runs out.

Workload (pinned, BENCHMARKS.md, Setup): every request is a distinct user text of exactly
``--prompt-tokens`` (64) tokens by the checkpoint's tokenizer, with speech output; no ``ref_audio``, so
code2wav uses the checkpoint's default voice, whose prompt features it caches after the first request;
the thinker speaks exactly ``--spoken-tokens`` tokens (``min_tokens = max_tokens``, ``ignore_eos``) cut
into a first hidden chunk of ``--first-chunk-tokens`` (10); the talker produces exactly
``--audio-frames`` codec frames (``fixed_frames``; 200 frames at 25 Hz = 8.0 s of audio); codec windows
are the profile's (``minicpmo_4_5``: first window 25 frames = 1 s of audio, 3 frames of left context).
The talker's fixed-frame mode gathers a turn's chunks before decoding (services/talker/engine.py), so
TTFP includes the thinker's whole spoken span; with the default ``--spoken-tokens 10`` the span is the
first chunk, which makes TTFP the streaming first-chunk path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chat_workload import Workload, add_workload_flags, make_prompts, request_body, workload_from_args
from bench.e2e_client import (
    LevelSummary,
    RequestResult,
    histogram_sums,
    markdown_table,
    percentiles,
    run_bursts,
    run_level,
)
from bench.launch import (
    Pipeline,
    add_launch_flags,
    environment,
    guarded_run,
    resolve_profile,
    stage_args_for,
)
from services.common.deploy_profile import STAGES

# Reference numbers shown next to ours (GH#7865: vLLM-Omni MiniCPM-o 4.5, 1×H100, chat
# route, Seed-TTS prompts; a different workload, so a side-by-side, not a like-for-like comparison).
REFERENCE = {
    "source": "vLLM-Omni MiniCPM-o 4.5 nightly baseline, 1xH100, Seed-TTS chat route (GH#7865)",
    "ttfp_ms": {"1": 458.16, "8": 2068.62},
    "rtf": {"8": 1.0324},
}
TARGETS = {"ttfp_p50_ms": {"1": 150.0, "8": 400.0}, "ttfp_p50_ms_floor_c1": 250.0, "rtf_mean_c8": 0.3}


# ---- measurement -----------------------------------------------------------------------------------
@dataclass
class LevelResult:
    summary: LevelSummary
    requests: list[RequestResult] = field(default_factory=list)
    bursts: list[dict[str, Any]] = field(default_factory=list)  # burst mode: one row per burst


async def timeline(
    url: str,
    bodies: list[dict[str, Any]],
    timeout: float,
    concurrency: int = 1,
    errors: list[dict[str, Any]] | None = None,
) -> list[dict[str, float]]:
    """Gateway-side marks (seconds from request start) of non-streaming requests, ``concurrency`` at once.

    At c > 1 the marks show which stage the extra time queues in front of (profile of TTFP under load).
    Each group of ``concurrency`` is sent on a client of its own (fresh connections, like a burst); the
    marks of a group's requests carry ``burst`` (its index) and ``send_index`` (its place in the group).
    A request that fails (an HTTP error status, a timeout, a dropped connection, a body that is not the
    expected JSON) is recorded in ``errors`` and the others go on: one slow request must not end the
    benchmark before it writes its results."""
    import httpx

    out: list[dict[str, float]] = []

    async def one(client: httpx.AsyncClient, body: dict[str, Any], burst: int, index: int) -> None:
        t0 = time.monotonic()
        try:
            resp = await client.post(url + "/v1/chat/completions", json=body, timeout=timeout)
            metrics = resp.json().get("metrics") if resp.status_code == 200 else None
            if metrics:
                marks = {k: float(v) for k, v in metrics.items()}
                out.append({**marks, "burst": float(burst), "send_index": float(index)})
                return
            error = f"HTTP {resp.status_code} {resp.text[:200]}"
        except (httpx.HTTPError, ValueError, AttributeError) as exc:  # timeouts, resets, bad JSON
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"[e2e] timeline request failed: {error}", flush=True)
        if errors is not None:
            errors.append(
                {
                    "burst": burst,
                    "send_index": index,
                    "concurrency": concurrency,
                    "error": error,
                    "after_s": round(time.monotonic() - t0, 3),
                }
            )

    for burst, start in enumerate(range(0, len(bodies), concurrency)):
        async with httpx.AsyncClient() as client:
            group = bodies[start : start + concurrency]
            await asyncio.gather(*(one(client, b, burst, i) for i, b in enumerate(group)))
    return out


TIMELINE_TAGS = ("burst", "send_index")  # request labels in the marks, not times


def summarize_timeline(marks: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = sorted({k for m in marks for k in m} - set(TIMELINE_TAGS))
    return {k: percentiles([m[k] * 1000 for m in marks if k in m]) for k in keys}


def level_verdicts(levels: list[LevelSummary]) -> list[str]:
    """Targets of issue 9 checked against what was measured (never against estimates)."""
    notes: list[str] = []
    for lv in levels:
        ttfp = lv.metrics.get("ttfp_ms", {}).get("p50")
        rtf = lv.metrics.get("rtf", {}).get("mean")
        target = TARGETS["ttfp_p50_ms"].get(str(lv.concurrency))
        if ttfp is not None and target is not None:
            ok = "meets" if ttfp <= target else "misses"
            notes.append(f"c={lv.concurrency}: TTFP p50 {ttfp:.0f} ms {ok} the {target:.0f} ms target")
            if lv.concurrency == 1:
                floor = TARGETS["ttfp_p50_ms_floor_c1"]
                notes.append(
                    f"c=1: TTFP p50 {'within' if ttfp <= floor else 'above'} the {floor:.0f} ms floor"
                )
        if lv.concurrency == 8 and rtf is not None:
            ok = "meets" if rtf <= TARGETS["rtf_mean_c8"] else "misses"
            notes.append(f"c=8: RTF mean {rtf:.3f} {ok} the {TARGETS['rtf_mean_c8']} target")
    return notes


def render_markdown(report: dict[str, Any], levels: list[LevelSummary]) -> str:
    w = report["workload"]
    lines = [
        f"## End-to-end chat route — profile `{report['profile']}`, {report['gpu_sharing']}",
        "",
        f"Workload: {w['prompt_tokens']}-token text prompts (distinct per request), default cached voice, "
        f"first thinker chunk {w['first_chunk_tokens']} tokens, {w['spoken_tokens']} spoken tokens, "
        f"talker fixed {w['audio_frames']} frames = {w['audio_seconds']:.1f} s of audio, codec windows "
        f"first {w['first_window_frames']} / then {w['window_frames']} frames with {w['left_context_frames']} "
        f"frames of left context. Warm-up: {report['warmup']} requests + {report['warmup_rounds']} round(s) "
        "of c requests per level.",
        "",
        markdown_table(levels),
        "",
    ]
    if any(lv.first_token_ms for lv in levels):
        lines += [
            "Where the streaming TTFT goes (means over each level's requests, ms): the client's TTFT; the "
            "gateway's, from its pipeline start to the first text delta; the thinker's, from engine submit "
            "to the first sampled token.",
            "",
            "| c | client TTFT mean | gateway TTFT mean | thinker TTFT mean |",
            "|---|---|---|---|",
        ]
        for lv in levels:
            ft = lv.first_token_ms
            client = lv.metrics.get("ttft_ms", {}).get("mean")
            cells = [client, ft.get("gateway_ttft_mean_ms"), ft.get("thinker_ttft_mean_ms")]
            lines.append(
                f"| {lv.concurrency} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells) + " |"
            )
        lines.append("")
    for c, rows in sorted((report.get("bursts") or {}).items(), key=lambda kv: int(kv[0])):
        lines += [
            f"Bursts at c={c} (all {c} requests sent at once, fresh connections per burst; ms):",
            "",
            "| burst | ok | TTFP p50 | TTFP max | TTFT p50 | TTFT per request, in send order "
            "| full GCs (process: n, ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            per = ", ".join("-" if v is None else f"{v:.0f}" for v in r["ttft_ms_in_send_order"])
            cells = [r["ttfp_p50_ms"], r["ttfp_max_ms"], r["ttft_p50_ms"]]
            gcs = r.get("full_gcs")
            gc_cell = (
                "–"
                if gcs is None
                else "; ".join(
                    f"{k}: {int(v['full_collections'])}, {v['pause_ms']:.0f}" for k, v in sorted(gcs.items())
                )
                or "none"
            )
            lines.append(
                f"| {r['burst']} | {r['ok']} | "
                + " | ".join("-" if v is None else f"{v:.0f}" for v in cells)
                + f" | {per} | {gc_cell} |"
            )
        lines.append("")
    by_c = report.get("timeline_ms_by_concurrency") or {}
    if by_c:
        cs = sorted(by_c, key=int)
        lines += [
            "Gateway timeline (ms from request start, non-streaming requests; at c > 1 they are sent "
            "together): p50 / p90",
            "",
        ]
        lines += [
            "| mark | " + " | ".join(f"c={c} (n={by_c[c]['n']})" for c in cs) + " |",
            "|---|" + "---|" * len(cs),
        ]
        keys = sorted(
            {k for c in cs for k in by_c[c]["marks"]},
            key=lambda k: by_c[cs[0]]["marks"].get(k, {}).get("p50", 0.0),
        )
        for key in keys:
            cells = []
            for c in cs:
                m = by_c[c]["marks"].get(key)
                cells.append(f"{m['p50']:.1f} / {m['p90']:.1f}" if m else "-")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    ref = report["reference"]
    lines += [
        f"Reference ({ref['source']}): TTFP {ref['ttfp_ms']['1']:.0f} ms at c=1, {ref['ttfp_ms']['8']:.0f} ms "
        f"at c=8; RTF {ref['rtf']['8']:.2f} at c=8.",
        "",
    ]
    lines += [f"- {note}" for note in report["verdicts"]]
    return "\n".join(lines) + "\n"


# First-token histograms read around each level, to place a client's TTFT: the gateway's (pipeline start
# -> first text delta) and the thinker's (engine submit -> first sampled token).
FIRST_TOKEN_HISTOGRAMS = ("minicpmo_gateway_time_to_first_token_seconds", "minicpmo_thinker_ttft_seconds")
_FIRST_TOKEN_PREFIX = "(?:minicpmo_gateway_time_to_first_token_|minicpmo_thinker_ttft_)"


def scrape_sums(urls: list[str]) -> dict[str, float]:
    """``<histogram>_sum`` and ``_count`` of :data:`FIRST_TOKEN_HISTOGRAMS`, added over ``urls``."""
    out: dict[str, float] = {}
    for url in urls:
        try:
            sums = histogram_sums(url, _FIRST_TOKEN_PREFIX)
        except OSError:
            continue  # a stage without a metrics port: its mean is left out
        for key, value in sums.items():
            out[key] = out.get(key, 0.0) + value
    return out


def first_token_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean of each first-token histogram over the requests between two scrapes, in ms."""
    out: dict[str, float] = {}
    for hist, key in zip(
        FIRST_TOKEN_HISTOGRAMS, ("gateway_ttft_mean_ms", "thinker_ttft_mean_ms"), strict=True
    ):
        n = after.get(f"{hist}_count", 0.0) - before.get(f"{hist}_count", 0.0)
        if n > 0:
            out[key] = 1000.0 * (after.get(f"{hist}_sum", 0.0) - before.get(f"{hist}_sum", 0.0)) / n
    return out


async def drive(
    args: argparse.Namespace,
    url: str,
    w: Workload,
    model: str,
    prompts: list[str],
    deadline: float,
    metrics_urls: list[str] | None = None,
    gc_urls: dict[str, str] | None = None,
    results: list[LevelResult] | None = None,
    marks: dict[int, list[dict[str, float]]] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> tuple[list[LevelResult], dict[int, list[dict[str, float]]]]:
    """The warm-up, each level (bursts or a steady level) and the timelines; ``gc_urls`` (process name ->
    ``/metrics``): the bursts also record each process's full garbage collections.

    ``results``, ``marks`` and ``errors`` (the timeline requests that failed) are filled as the run goes,
    so a caller that catches an exception still reports every level measured before it."""
    bodies = [request_body(p, w, model) for p in prompts]
    metrics_urls = metrics_urls if metrics_urls is not None else [url.rstrip("/") + "/metrics"]
    timeout = args.request_timeout
    if args.warmup:
        print(f"[e2e] warm-up: {args.warmup} request(s) at c=1", flush=True)
        summary, _ = await run_level(
            url,
            {},
            1,
            args.warmup,
            timeout,
            bodies=bodies[-args.warmup :],
            deadline=deadline,
            require_audio=True,
        )
        if summary.failed:
            raise RuntimeError("warm-up request failed; see the lines above and the stage logs")
    results = [] if results is None else results
    marks = {} if marks is None else marks
    if args.timeline_first:
        marks.update(await _timelines(args, url, w, model, prompts, deadline, errors))
    for c in args.levels:
        if time.monotonic() >= deadline:
            print(f"[e2e] out of time before c={c}; skipping the remaining levels", flush=True)
            break
        if args.warmup_rounds:
            n = args.warmup_rounds * c
            print(f"[e2e] c={c}: warm-up {n} request(s)", flush=True)
            await run_level(url, {}, c, n, timeout, progress=False, bodies=bodies[:n], deadline=deadline)
        before = await asyncio.to_thread(scrape_sums, metrics_urls)
        bursts: list[dict[str, Any]] = []
        if args.bursts and c > 1:
            print(f"[e2e] c={c}: {args.bursts} burst(s) of {c}, fresh connections each", flush=True)
            summary, reqs, bursts = await run_bursts(
                url,
                c,
                args.bursts,
                timeout,
                bodies=bodies,
                deadline=deadline,
                require_audio=True,
                gc_urls=gc_urls,
            )
        else:
            print(f"[e2e] c={c}: {args.requests_per_level} request(s)", flush=True)
            summary, reqs = await run_level(
                url,
                {},
                c,
                args.requests_per_level,
                timeout,
                bodies=bodies,
                deadline=deadline,
                require_audio=True,
            )
        # After the last response the gateway has observed every request's histograms (at finish).
        summary.first_token_ms = first_token_means_ms(
            before, await asyncio.to_thread(scrape_sums, metrics_urls)
        )
        results.append(LevelResult(summary, reqs, bursts))
        m = summary.metrics
        print(
            f"[e2e] c={c} done: {summary.requests} req, {summary.failed} failed, {summary.req_per_s:.2f} req/s, "
            f"TTFP p50 {m['ttfp_ms'].get('p50', float('nan')):.0f} ms, "
            f"RTF mean {m['rtf'].get('mean', float('nan')):.3f}",
            flush=True,
        )
    if not args.timeline_first:
        marks.update(await _timelines(args, url, w, model, prompts, deadline, errors))
    return results, marks


async def _timelines(
    args: argparse.Namespace,
    url: str,
    w: Workload,
    model: str,
    prompts: list[str],
    deadline: float,
    errors: list[dict[str, Any]] | None = None,
) -> dict[int, list[dict[str, float]]]:
    """The non-streaming marks at c=1 and at the top level; with ``--timeline-first`` the top level goes
    first, so its first burst meets the server just after start-up (what a first burst's stages cost)."""
    marks: dict[int, list[dict[str, float]]] = {}
    top = max(args.levels) if args.levels else 1
    for c in sorted({1, top}, reverse=bool(args.timeline_first)):
        n = args.timeline_requests if c == 1 else top * max(1, args.timeline_bursts)
        if not args.timeline_requests or time.monotonic() >= deadline:
            break
        print(f"[e2e] timeline: {n} non-streaming request(s) at c={c}", flush=True)
        tl_bodies = [request_body(p, w, model, stream=False) for p in prompts[:n]]
        marks[c] = await timeline(url, tl_bodies, args.request_timeout, concurrency=c, errors=errors)
    return marks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    add_launch_flags(p)
    p.add_argument(
        "--url", default=None, help="benchmark an already running gateway instead of launching one"
    )
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    p.add_argument("--requests-per-level", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="requests at c=1 before the first level")
    p.add_argument(
        "--warmup-rounds", type=int, default=1, help="untimed rounds of c requests before each level"
    )
    p.add_argument("--timeline-requests", type=int, default=5, help="non-streaming requests with stage marks")
    p.add_argument(
        "--bursts",
        type=int,
        default=0,
        help="levels c > 1 send this many bursts of c requests at once, each on fresh connections, instead "
        "of --requests-per-level with c in flight (with --warmup-rounds 0 the first burst after start counts)",
    )
    p.add_argument(
        "--timeline-bursts",
        type=int,
        default=1,
        help="non-streaming bursts of the top level with stage marks",
    )
    p.add_argument(
        "--timeline-first",
        action="store_true",
        help="run the non-streaming marks (top level first) right after the warm-up, before the levels",
    )
    add_workload_flags(p, 200, "talker frames (25 per second of audio)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=480.0,
        help="overall budget; levels stop being started/sent after it (teardown follows)",
    )
    p.add_argument("--out-dir", default=None, help="default: $OUT/e2e or ./bench-results/e2e")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.max_seconds
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    w = workload_from_args(args)
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "e2e")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import httpx  # noqa: F401 - fail before launching anything
    except ImportError:
        print("bench.e2e needs httpx (pip install httpx, or add it to the GPU host wheels)", file=sys.stderr)
        return 2

    from services.common.checkpoint import Checkpoint

    checkpoint = Path(args.checkpoint)
    profile = resolve_profile(args, w)
    stage_args = stage_args_for(args, profile)
    talker = profile.stage("talker")
    n_prompts = max(
        args.requests_per_level,
        max(args.levels) * max(args.warmup_rounds, 1),
        args.warmup,
        args.timeline_requests,
        max(args.levels) * max(args.bursts, args.timeline_bursts),
        1,
    )
    print(f"[e2e] building {n_prompts} prompts of {w.prompt_tokens} tokens", flush=True)
    prompts = make_prompts(Checkpoint(checkpoint).tokenizer(), n_prompts, w.prompt_tokens)
    devices = {s: list(profile.stage(s).devices) for s in STAGES}
    report: dict[str, Any] = {
        "bench": "e2e",
        "profile": profile.name,
        "profile_source": profile.source,
        "devices": devices,
        # What ran: the launch sets it; against --url the bench does not know how the stages share a GPU.
        "gpu_sharing": "external (stages not launched by the bench)" if args.url else "CPU",
        "stage_args": stage_args,
        "checkpoint": str(checkpoint.resolve()),
        "workload": {
            **asdict(w),
            "audio_seconds": w.audio_seconds,
            "first_window_frames": talker.codec.first_window_frames,
            "window_frames": talker.codec.window_frames,
            "left_context_frames": talker.codec.left_context_frames,
            "hidden_chunk_tokens": profile.stage("thinker").hidden_chunk_tokens,
            "voice": "checkpoint default (cached by code2wav after first use)",
        },
        "warmup": args.warmup,
        "warmup_rounds": args.warmup_rounds,
        "requests_per_level": args.requests_per_level,
        "bursts_per_level": args.bursts,
        "timeline_first": bool(args.timeline_first),
        "timeline_requests": args.timeline_requests,
        "environment": environment(),
        "reference": REFERENCE,
        "targets": TARGETS,
        "status": "started",
    }
    levels: list[LevelResult] = []
    marks: dict[int, list[dict[str, float]]] = {}
    timeline_errors: list[dict[str, Any]] = []
    with guarded_run(report, "e2e") as run:
        url = args.url
        if url is None:
            pipeline = Pipeline(profile, checkpoint, out_dir / "logs", stage_args)
            run.teardown.append(pipeline.stop)
            pipeline.start()
            report["gpu_sharing"] = pipeline.gpu_sharing
            budget = min(args.startup_timeout, max(1.0, deadline - time.monotonic()))
            report["startup_s"] = pipeline.wait_healthy(budget)
            print(f"[e2e] pipeline healthy after {report['startup_s']:.1f} s at {pipeline.url}", flush=True)
            url = pipeline.url
            from bench.cancel import stage_endpoints

            endpoints = stage_endpoints(pipeline)
            metrics_urls = [url.rstrip("/") + "/metrics"] + [
                ep.metrics_url for ep in endpoints if ep.stage == "thinker"
            ]
            gc_urls = {"gateway": url.rstrip("/") + "/metrics"} | {
                ep.name: ep.metrics_url for ep in endpoints
            }
        else:
            metrics_urls = [url.rstrip("/") + "/metrics"]
            gc_urls = {"gateway": metrics_urls[0]}
        report["url"] = url
        asyncio.run(
            drive(
                args,
                url,
                w,
                profile.served_model_name,
                prompts,
                deadline,
                metrics_urls,
                gc_urls,
                results=levels,
                marks=marks,
                errors=timeline_errors,
            )
        )
        report["status"] = "ok" if levels and not any(lv.summary.failed for lv in levels) else "failures"
        if len(levels) < len(args.levels):
            report["status"] = "incomplete"
    rc = run.rc
    summaries = [lv.summary for lv in levels]
    report["levels"] = [asdict(lv.summary) for lv in levels]
    report["requests"] = {str(lv.summary.concurrency): [asdict(r) for r in lv.requests] for lv in levels}
    report["bursts"] = {str(lv.summary.concurrency): lv.bursts for lv in levels if lv.bursts}
    report["timeline_raw_ms"] = {
        str(c): [{k: v if k in TIMELINE_TAGS else 1000 * v for k, v in m.items()} for m in ms]
        for c, ms in sorted(marks.items())
        if c > 1
    }
    report["timeline_ms"] = summarize_timeline(marks.get(1, []))
    report["timeline_ms_by_concurrency"] = {
        str(c): {"n": len(m), "marks": summarize_timeline(m)} for c, m in sorted(marks.items()) if m
    }
    report["timeline_errors"] = timeline_errors
    report["verdicts"] = level_verdicts(summaries)
    if timeline_errors:
        report["verdicts"].append(f"{len(timeline_errors)} timeline request(s) failed (see timeline_errors)")
    report["wall_s"] = time.monotonic() - t_start
    (out_dir / "e2e.json").write_text(json.dumps(report, indent=2))
    md = render_markdown(report, summaries)
    (out_dir / "e2e.md").write_text(md)
    print(md, flush=True)
    print(
        f"[e2e] status: {report['status']}; wrote {out_dir / 'e2e.json'} and {out_dir / 'e2e.md'}", flush=True
    )
    if rc == 0 and report["status"] != "ok":
        rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
