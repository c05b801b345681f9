"""Realtime duplex at scale: 1/4/8/16 concurrent sessions paced in real time (issues 7 and 16).

    python -m bench.realtime_duplex --checkpoint CKPT [--deploy-config minicpmo_4_5] [--device cuda] \
        [--sessions 1 4 8 16] [--duration 60] [--lanes turn native] [--out-dir DIR]   # launches the pipeline
    python -m bench.realtime_duplex --url ws://127.0.0.1:8099 --ref-audio voice.wav \
        [--http-url http://127.0.0.1:8099] [--out results.json]                       # a running gateway

Each session runs the controlled workload of :mod:`bench.realtime_workload` for ``--duration`` seconds:
the turn lane (2 s of speech, a response speaking up to ``--units`` units, 2 s of speech, a response with
a barge-in at its first audio delta, again), and separately the native lane (speech and silence
streamed continuously, the model deciding when to speak, a final commit at the end). Reported per lane
and level (JSON + Markdown):

* ``unit_rtf`` p50/p90/p99: per audio delta after a response's first, the time since the previous delta
  divided by the audio it carried (client side);
* underruns by the client playout model (playback 200 ms after the first delta; an underrun: the
  received audio runs out before the next delta), count and total ms per session;
* ``first_audio_s``: commit (+ ``response.create``) to the first audio delta (turn lane), and its split at
  the gateway (``minicpmo_realtime_first_audio_phase_seconds``: the request to the requesting unit's
  decision, the first speech chunk, the talker's first codec window, code2wav's first audio), and
  code2wav's own first-window time (``minicpmo_code2wav_first_window_seconds``: a first window's arrival
  at the stage to its audio routed);
* ``barge_in_ms``: ``barge_in`` sent to the cancelled ``response.done`` (client side), the gateway's
  ``minicpmo_realtime_barge_in_seconds``, and each stage's drain
  (``minicpmo_stage_interrupt_drain_seconds``: interrupt received -> last engine step of the old epoch);
* the thinker's unit split (queued / encode / behind / engine; behind and engine again for the units that
  request a response), step split (forward / host, i.e. the rest of the
  step: sampling, its sync, events), each stage's mean engine batch size, the streaming-Whisper batch
  size (units per encode call), and each stage's busy share: its engine step seconds per wall second
  (a host-side proxy; with ``pynvml`` installed also the NVML per-process SM utilisation);
* the gateway's unit decision time (``minicpmo_realtime_unit_decision_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.e2e_client import histogram_sums
from bench.launch import add_gpu_sharing_flags
from bench.realtime_workload import SessionPlan, SessionResult, native_session, turn_session

# Stage histograms read per level: barge-in drain, engine step time and batch size of every stage; the
# thinker's split of a duplex unit (queued / encode / behind / engine) and of a step (forward / sample),
# its steps by path (graph / graph_mixed / eager) and its streaming-Whisper batch size; code2wav's later
# windows that were past their deadline on arrival or when done.
STAGE_PREFIXES = (
    "(?:minicpmo_stage_interrupt_drain_|minicpmo_stage_step_|minicpmo_stage_batch_|"
    "minicpmo_thinker_duplex_unit_|minicpmo_thinker_step_phase_|minicpmo_thinker_step_path_|"
    "minicpmo_thinker_whisper_|"
    "minicpmo_code2wav_late_window_|minicpmo_code2wav_first_window_)"
)
STAGES = ("thinker", "talker", "code2wav")
STEP_PATHS = ("graph", "graph_mixed", "eager")  # services.thinker.runner.STEP_PATHS (no torch import here)
# The thinker's duplex unit split (minicpmo_thinker_duplex_unit_seconds{phase}): every unit's four
# phases, then behind and engine again for the units that request a response.
UNIT_PHASES = ("queued", "encode", "behind", "engine", "request_behind", "request_engine")


def _scrape(http_url: str | None, stage_urls: list[str] | None = None) -> dict[str, float]:
    """Histogram sums/counts of the gateway (minicpmo_realtime_*) and of the stages (STAGE_PREFIXES)."""
    out: dict[str, float] = {}
    if http_url:
        out.update(histogram_sums(f"{http_url}/metrics", "minicpmo_realtime_"))
    for url in stage_urls or []:
        for k, v in histogram_sums(url, STAGE_PREFIXES).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _pct(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "n": len(values),
    }


class NvmlSampler:
    """Mean SM utilisation per stage process from NVML's per-process accounting (when pynvml is there)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[int]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - optional: no NVML, no GPU, or no package
            return
        self._thread = threading.Thread(target=self._run, args=(pynvml,), daemon=True)
        self._thread.start()

    def _run(self, pynvml: Any) -> None:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        by_pid = {pid: name for name, pid in self.pids.items()}
        last = 0
        while not self._stop.wait(0.5):
            for handle in handles:
                try:
                    rows = pynvml.nvmlDeviceGetProcessUtilization(handle, last)
                except Exception:  # noqa: BLE001 - no samples yet in this window
                    continue
                for row in rows:
                    last = max(last, int(row.timeStamp))
                    if row.pid in by_pid:
                        self.samples[by_pid[row.pid]].append(int(row.smUtil))

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        return {name: (sum(v) / len(v) / 100 if v else None) for name, v in self.samples.items()}


PROGRESS_EVERY_S = 10.0  # a progress line per level this often, so a run cut short shows where it was


def level_deadline(args: argparse.Namespace) -> float:
    """Seconds a level may run before its unfinished sessions are stopped (``--level-timeout``; default
    twice the session duration plus two minutes, for the last response and the close)."""
    given = getattr(args, "level_timeout", None)
    return float(given) if given is not None else 2 * args.duration + 120.0


async def _sessions(args: argparse.Namespace, lane: str, n: int, ref_uri: str) -> list[Any]:
    """Run ``n`` sessions of ``lane`` at once; one still running at the level's deadline is cancelled and
    returned as what it measured so far, with an ``unfinished`` error (it counts as failed), so a level
    that cannot keep up is reported instead of holding the run until an outer time limit kills it."""
    script = turn_session if lane == "turn" else native_session
    plan = SessionPlan(args.url, ref_uri, args.duration, args.units)
    results = [SessionResult(lane) for _ in range(n)]
    stagger_s = float(getattr(args, "stagger_s", 0.0) or 0.0)

    async def started(i: int, result: SessionResult) -> SessionResult:
        await asyncio.sleep(i * stagger_s / n)  # 0 for every session without --stagger-s
        return await script(plan, result=result)

    tasks = [asyncio.create_task(started(i, result)) for i, result in enumerate(results)]
    deadline_s = level_deadline(args)
    t0 = time.monotonic()
    pending: set[asyncio.Task[SessionResult]] = set(tasks)
    while pending:
        left = deadline_s - (time.monotonic() - t0)
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(PROGRESS_EVERY_S, left))
        if pending:
            print(progress_line(time.monotonic() - t0, n - len(pending), results), flush=True)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    out: list[Any] = []
    for task, result in zip(tasks, results, strict=True):
        if task in pending:
            result.errors.append(
                {
                    "code": "unfinished",
                    "message": f"session still running after the {deadline_s:g} s deadline",
                }
            )
            out.append(result)
        elif task.exception() is not None:
            out.append(task.exception())
        else:
            out.append(task.result())
    return out


def progress_line(elapsed_s: float, finished: int, results: list[SessionResult]) -> str:
    """One line on a running level: sessions finished, responses done, unit RTF p90 and underruns so far."""
    rtf = _pct([v for r in results for c in r.responses for v in c.unit_rtf])
    underruns = sum(c.underruns for r in results for c in r.responses)
    done = sum(c.status is not None for r in results for c in r.responses)
    p90 = f"{rtf['p90']:.3f}" if rtf else "-"
    return (
        f"[realtime]   {elapsed_s:5.0f} s: {finished}/{len(results)} sessions finished, {done} responses "
        f"done, unit RTF p90 {p90}, underruns {underruns}"
    )


def run_level(
    args: argparse.Namespace,
    lane: str,
    n: int,
    ref_uri: str,
    stage_urls: list[str] | None = None,
    pids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One lane at one concurrency level: run the sessions, then fold client timings and metric deltas."""
    before = _scrape(args.http_url, stage_urls)
    nvml = NvmlSampler(pids or {})
    nvml.start()
    t0 = time.monotonic()
    results = asyncio.run(_sessions(args, lane, n, ref_uri))
    wall = time.monotonic() - t0
    gpu = nvml.stop()
    after = _scrape(args.http_url, stage_urls)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok = [r for r in results if isinstance(r, SessionResult)]
    per_session = [r.summary() for r in ok]
    level: dict[str, Any] = {
        "lane": lane,
        "sessions": n,
        "wall_s": wall,
        "failed": len(results) - len(ok) + sum(bool(s["errors"]) for s in per_session),
        "unfinished": sum(any(e.get("code") == "unfinished" for e in s["errors"]) for s in per_session),
        "errors": [repr(r)[:300] for r in results if not isinstance(r, SessionResult)]
        + [e for s in per_session for e in s["errors"]][:20],
        "responses": sum(s["responses"] for s in per_session),
        "completed": sum(s["completed"] for s in per_session),
        "unit_rtf": _pct([v for r in ok for c in r.responses for v in c.unit_rtf]),
        "first_audio_s": _pct([x for r in ok for x in r.first_audio_s]),
        "barge_in_ms": _pct([x for r in ok for x in r.barge_in_ms]),
        "underruns_per_session": _pct([float(s["underruns"]) for s in per_session]),
        "underrun_ms_per_session": _pct([s["underrun_ms"] for s in per_session]),
        "underruns_total": sum(s["underruns"] for s in per_session),
        # every underrun as (seconds after the level started, session index, ms): a stall that hits all
        # sessions at once shows as one time with every session in it
        "underrun_times": sorted(
            (round(when - t0, 3), i, round(ms, 1))
            for i, s in enumerate(per_session)
            for when, ms in s["underrun_at"]
        ),
        "audio_s": sum(s["audio_s"] for s in per_session),
    }
    level.update(_metric_means(delta, wall))
    level["gpu_sm_share"] = gpu
    return level


def _metric_means(delta: dict[str, float], wall: float) -> dict[str, Any]:
    """Means (ms, or plain for sizes) of the histograms' deltas over a level, and busy shares."""

    def mean(name: str, scale: float = 1000.0) -> float | None:
        count = delta.get(name.replace("{", "_count{", 1) if "{" in name else name + "_count", 0.0)
        if not count:
            return None
        return scale * delta[name.replace("{", "_sum{", 1) if "{" in name else name + "_sum"] / count

    out: dict[str, Any] = {
        "unit_decision_mean_ms": mean("minicpmo_realtime_unit_decision_seconds"),
        "gateway_barge_in_mean_ms": mean("minicpmo_realtime_barge_in_seconds"),
        "whisper_batch_mean": mean("minicpmo_thinker_whisper_batch_size", 1.0),
    }
    for stage in STAGES:
        out[f"{stage}_interrupt_ack_mean_ms"] = mean(
            f'minicpmo_realtime_stage_interrupt_ack_seconds{{stage="{stage}"}}'
        )
        out[f"{stage}_drain_mean_ms"] = mean(f'minicpmo_stage_interrupt_drain_seconds{{stage="{stage}"}}')
        out[f"{stage}_batch_mean"] = mean(f'minicpmo_stage_batch_size{{stage="{stage}"}}', 1.0)
        busy = delta.get(f'minicpmo_stage_step_seconds_sum{{stage="{stage}"}}')
        out[f"{stage}_busy_share"] = busy / wall if busy is not None and wall > 0 else None
    for phase in UNIT_PHASES:
        out[f"thinker_unit_{phase}_mean_ms"] = mean(
            f'minicpmo_thinker_duplex_unit_seconds{{phase="{phase}"}}'
        )
    for phase in ("decision", "speech", "window", "audio"):
        out[f"first_audio_{phase}_mean_ms"] = mean(
            f'minicpmo_realtime_first_audio_phase_seconds{{phase="{phase}"}}'
        )
    for phase in ("forward", "sample"):
        out[f"thinker_step_{phase}_mean_ms"] = mean(f'minicpmo_thinker_step_phase_seconds{{phase="{phase}"}}')
    for path in STEP_PATHS:
        hist = f'minicpmo_thinker_step_path_seconds{{path="{path}"}}'
        out[f"thinker_steps_{path}"] = delta.get(hist.replace("{", "_count{", 1), 0.0)
        out[f"thinker_step_{path}_mean_ms"] = mean(hist)
    # Code2wav's first window of a stream: its arrival at the stage to its audio routed.
    out["code2wav_first_window_mean_ms"] = mean("minicpmo_code2wav_first_window_seconds")
    for phase in ("arrived", "done"):
        late = f'minicpmo_code2wav_late_window_seconds{{phase="{phase}"}}'
        out[f"code2wav_late_{phase}_windows"] = delta.get(late.replace("{", "_count{", 1), 0.0)
        out[f"code2wav_late_{phase}_mean_ms"] = mean(late)
    return out


def render_markdown(levels: list[dict[str, Any]]) -> str:
    def f(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    def p(d: dict[str, float] | None, key: str, scale: float = 1.0, digits: int = 3) -> str:
        return "-" if not d else f(d[key] * scale, digits)

    lines = [
        "| sessions | lane | failed | unit RTF p50 / p90 / p99 | underruns per session p50 / total, ms p50 | "
        "first audio p50 / p90 ms | first audio split: decision / speech / window / audio, mean ms | barge-in client p50 ms, stage drain ms thinker / talker / code2wav | "
        "thinker step ms forward / host, batch | Whisper batch | busy share thinker / talker / code2wav |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        rtf = " / ".join(p(lv["unit_rtf"], k) for k in ("p50", "p90", "p99"))
        under = lv["underruns_per_session"]
        unders = (
            "-"
            if not under
            else f"{under['p50']:.0f} / {lv['underruns_total']}, "
            + p(lv["underrun_ms_per_session"], "p50", digits=0)
        )
        first = " / ".join(p(lv["first_audio_s"], k, 1000, 0) for k in ("p50", "p90"))
        drains = " / ".join(f(lv.get(f"{s}_drain_mean_ms"), 2) for s in STAGES)
        split = " / ".join(
            f(lv.get(f"first_audio_{k}_mean_ms"), 0) for k in ("decision", "speech", "window", "audio")
        )
        step = (
            f"{f(lv.get('thinker_step_forward_mean_ms'), 2)} / {f(lv.get('thinker_step_sample_mean_ms'), 2)}, "
            f"{f(lv.get('thinker_batch_mean'), 1)}"
        )
        busy = " / ".join(f(lv.get(f"{s}_busy_share"), 2) for s in STAGES)
        lines.append(
            f"| {lv['sessions']} | {lv['lane']} | {lv['failed']} | {rtf} | {unders} | {first} | {split} | "
            f"{p(lv['barge_in_ms'], 'p50', digits=0)}, {drains} | {step} | "
            f"{f(lv.get('whisper_batch_mean'), 1)} | {busy} |"
        )
    for lv in levels:
        phases = " / ".join(f(lv.get(f"thinker_unit_{k}_mean_ms"), 1) for k in UNIT_PHASES[:4])
        requested = " / ".join(f(lv.get(f"thinker_unit_{k}_mean_ms"), 1) for k in UNIT_PHASES[4:])
        lines.append(
            f"\nThinker unit split at {lv['sessions']} sessions ({lv['lane']}; mean ms): unit sent to decision "
            f"{f(lv.get('unit_decision_mean_ms'), 1)} at the gateway; queued / encode / behind / engine "
            f"{phases}; units that request a response, behind / engine {requested}"
        )
    for lv in levels:
        if any(lv.get(f"thinker_steps_{k}") for k in STEP_PATHS):
            paths = "; ".join(
                f"{k} {lv[f'thinker_steps_{k}']:.0f} (mean {f(lv.get(f'thinker_step_{k}_mean_ms'), 2)} ms)"
                for k in STEP_PATHS
            )
            lines.append(f"\nThinker steps at {lv['sessions']} sessions ({lv['lane']}; forward): {paths}")
    for lv in levels:
        if "code2wav_late_done_windows" in lv:
            late = "; ".join(
                f"{k} {lv[f'code2wav_late_{k}_windows']:.0f} (mean {f(lv.get(f'code2wav_late_{k}_mean_ms'), 0)} ms)"
                for k in ("arrived", "done")
            )
            lines.append(
                f"\nCode2wav later windows past their deadline at {lv['sessions']} sessions ({lv['lane']}; the "
                f"listener starting at the first audio, without the client's lead): {late}"
            )
    for lv in levels:
        if lv.get("code2wav_first_window_mean_ms") is not None:
            lines.append(
                f"\nCode2wav first windows at {lv['sessions']} sessions ({lv['lane']}): arrival at the stage "
                f"to audio routed {f(lv['code2wav_first_window_mean_ms'], 1)} ms (mean)"
            )
    for lv in levels:
        if lv.get("underrun_times"):
            when = "; ".join(f"{t:.1f} s #{i} {ms:.0f} ms" for t, i, ms in lv["underrun_times"][:24])
            lines.append(
                f"\nUnderruns at {lv['sessions']} sessions ({lv['lane']}; time after the level's start, session, ms): {when}"
            )
    return "\n".join(lines) + "\n"


def with_session_room(profile: Any, sessions: int) -> Any:
    """``profile`` with the gateway admitting ``sessions`` realtime sessions (a level above the profile's
    ``max_realtime_sessions``, e.g. 24 on the 16-session profile, would otherwise be refused in part).
    The thinker's ``max_num_seqs`` is left alone: a level beyond it queues, which the bench reports."""
    if sessions <= profile.gateway.max_realtime_sessions:
        return profile
    print(f"[realtime] gateway max_realtime_sessions raised to {sessions} for this run", flush=True)
    return profile.with_overrides({"gateway": {"max_realtime_sessions": sessions}})


def _launch(args: argparse.Namespace) -> tuple[Any, list[str], dict[str, int]]:
    """Start the pipeline for ``--checkpoint`` with the profile; point the bench at it."""
    from bench.cancel import stage_endpoints
    from bench.launch import Pipeline, with_gpu_sharing
    from services.common.checkpoint import Checkpoint
    from services.common.deploy_profile import load_profile, parse_overrides

    profile = load_profile(args.deploy_config).with_device(args.device)
    if args.stage_overrides:
        profile = profile.with_overrides(parse_overrides(args.stage_overrides))
    profile = with_gpu_sharing(profile, args)
    profile = with_session_room(profile, max(args.sessions))
    # Stage logs go with the results ($OUT on a device machine), so a failed start keeps them.
    out = Path(args.out_dir or Path(os.environ.get("OUT", ".")) / "realtime_duplex")
    pipeline = Pipeline(profile, Path(args.checkpoint), out / "logs", {})
    pipeline.start()  # with gpu_sharing mps it starts a private MPS daemon first (stopped by stop())
    args.sharing = pipeline.gpu_sharing
    try:
        took = pipeline.wait_healthy(args.startup_timeout)
    except BaseException:
        pipeline.stop()
        raise
    print(f"[realtime] pipeline healthy after {took:.1f} s at {pipeline.url}", flush=True)
    args.url = pipeline.url.replace("http://", "ws://")
    args.http_url = pipeline.url
    if not args.ref_audio:
        args.ref_audio = str(Checkpoint(args.checkpoint).ref_audio_path)
    endpoints = stage_endpoints(pipeline)
    pids = {ep.stage: pipeline.supervisor.procs[ep.name].pid for ep in endpoints}
    return pipeline, [ep.metrics_url for ep in endpoints], pids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8099")
    p.add_argument("--http-url", default=None, help="gateway HTTP base for /metrics (optional)")
    p.add_argument("--checkpoint", default=None, help="launch the pipeline on this checkpoint (launch mode)")
    p.add_argument("--deploy-config", default="minicpmo_4_5")
    p.add_argument("--device", default="cuda")
    p.add_argument("--stage-overrides", default=None, help="JSON, as minicpmo-serve takes it")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument(
        "--lanes",
        nargs="+",
        choices=("turn", "native"),
        default=["turn", "native"],
        help="workloads to run at every level (reported separately)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds each session runs its workload (real-time paced; the last cycle finishes)",
    )
    p.add_argument("--units", type=int, default=12, help="max units per response (the issue asks >= 10)")
    p.add_argument(
        "--level-timeout",
        type=float,
        default=None,
        help="seconds a level may run; sessions still running then are stopped and reported as unfinished "
        "with what they measured (default: 2 x --duration + 120)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="sessions run once (one short turn-lane cycle), unmeasured, before the first level",
    )
    p.add_argument(
        "--stagger-s",
        type=float,
        default=0.0,
        help="spread a level's session starts evenly over this many seconds (session i starts i/n of it "
        "late), as independent users would arrive; 0 (default) starts them together, the worst case, "
        "whose alignment lasts a varying part of the level",
    )
    p.add_argument("--ref-audio", default=None, help="voice WAV (default: the checkpoint's, in launch mode)")
    add_gpu_sharing_flags(p)
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--out-dir", default=None, help="directory for realtime.json, realtime.md and logs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.gpu_sharing != "profile" and not args.checkpoint:
        p.error("--gpu-sharing/--mps needs --checkpoint (it launches the stages itself)")
    pipeline = None
    stage_urls: list[str] = []
    pids: dict[str, int] = {}
    if args.checkpoint:
        pipeline, stage_urls, pids = _launch(args)
    elif not args.ref_audio:
        p.error("--ref-audio is required without --checkpoint")
    levels = []
    try:
        ref_uri = "data:audio/wav;base64," + base64.b64encode(Path(args.ref_audio).read_bytes()).decode()
        if args.warmup > 0:
            print(f"[realtime] warm-up: {args.warmup} session(s)", flush=True)
            warm_args = argparse.Namespace(**{**vars(args), "duration": 0.0})
            warm = run_level(warm_args, "turn", args.warmup, ref_uri, stage_urls)
            if warm["failed"]:
                print(f"[realtime] warm-up failures: {warm['errors']}", flush=True)
        for lane in args.lanes:
            for n in args.sessions:
                print(
                    f"[realtime] {lane} lane, {n} concurrent session(s), {args.duration:g} s each", flush=True
                )
                levels.append(run_level(args, lane, n, ref_uri, stage_urls, pids))
                _write(args, levels, final=False)  # a run cut short by its time limit keeps what it measured
    finally:
        if pipeline is not None:
            pipeline.stop()
    _write(args, levels, final=True)
    return 1 if any(lv["failed"] for lv in levels) else 0


def _write(args: argparse.Namespace, levels: list[dict[str, Any]], *, final: bool) -> None:
    """JSON + Markdown of the levels so far (``--out``, ``--out-dir``); printed once at the end."""
    sharing = getattr(args, "sharing", None) or "external (stages not launched by the bench)"
    text = json.dumps({"gpu_sharing": sharing, "duration_s": args.duration, "levels": levels}, indent=2)
    md = render_markdown(levels)
    if final:
        print(text)
        print(md, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "realtime.json").write_text(text)
        (Path(args.out_dir) / "realtime.md").write_text(md)


if __name__ == "__main__":
    raise SystemExit(main())
