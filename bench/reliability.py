"""Reliability runs that are too long for CI: HTTP fuzzing, WebSocket frame fuzzing, disconnect storms, soak.

    python -m bench.reliability fuzz-http --max-examples 200 --out results/rel
    python -m bench.reliability fuzz-ws --frames 1000 --out results/rel
    python -m bench.reliability storm --chat 1000 --realtime 200 --out results/rel
    python -m bench.reliability soak --minutes 20 --chat 8 --duplex 8 --out results/rel

Each launches the whole pipeline on the tiny checkpoint on CPU (the launcher's own child plan, free
ports, :class:`bench.launch.Pipeline`; replies kept short by profile overrides), runs a bounded load, then
checks what issue 19 asks: no 5xx for a client error, the server still healthy, every stage gauge
(``minicpmo_stage_in_flight``, ``minicpmo_stage_streams_active``) back to 0, and the RSS of every process
within ``--rss-bound-mib`` of where it started. ``RUN.json`` under ``--out`` holds the figures; the
exit status is 0 only when every check passed. docs/reliability.md quotes the figures and commands.
(One module a little over 500 lines: the four runs share the pipeline, the realtime client and the
verdict, and splitting the CLI from them would only add an import hop.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {"thinker": {"sampling": {"max_tokens": 8}}, "talker": {"sampling": {"max_new_frames": 25}}}
_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


# ---- the pipeline and what it reports -----------------------------------------------------------
def start_pipeline(out: Path, overrides: dict[str, Any] | None = None) -> Any:
    from bench.launch import Pipeline
    from gateway.launcher import ensure_tiny_checkpoint
    from services.common.deploy_profile import load_profile

    profile = load_profile("cpu").with_overrides(OVERRIDES).with_overrides(overrides or {})
    pipe = Pipeline(profile, ensure_tiny_checkpoint(), out / "logs", {})
    pipe.start()
    pipe.wait_healthy(900)
    return pipe


# Everything a stage holds for a request: open streams, admitted requests, queued work, engine
# sequences, KV cache bytes. All must read 0 once no client is connected.
_IDLE_GAUGES = (
    "minicpmo_stage_in_flight",
    "minicpmo_stage_streams_active",
    "minicpmo_stage_queue_depth",
    "minicpmo_thinker_running",
    "minicpmo_thinker_sequences",
    "minicpmo_thinker_kv_used_bytes",
    "minicpmo_talker_engine_streams",
    "minicpmo_code2wav_streams",
    "minicpmo_code2wav_cache_bytes",
)


def stage_gauges(pipe: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for child in pipe.children:
        if child.stage is None:
            continue
        text = httpx.get(f"http://127.0.0.1:{child.port + 1000}/metrics", timeout=10).text
        for name in _IDLE_GAUGES:
            values = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
            if values:
                out[f"{child.name}.{name.removeprefix('minicpmo_')}"] = sum(float(v) for v in values)
    return out


def rss_mib(pipe: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, proc in pipe.supervisor.procs.items():
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = int(line.split()[1]) / 1024
        except FileNotFoundError:
            out[name] = -1.0
    return out


def settle(pipe: Any, timeout_s: float = 30.0) -> tuple[dict[str, float], float]:
    """Wait until every stage gauge reads 0; (gauges, seconds waited)."""
    start = time.monotonic()
    gauges = stage_gauges(pipe)
    while any(gauges.values()) and time.monotonic() - start < timeout_s:
        time.sleep(0.25)
        gauges = stage_gauges(pipe)
    return gauges, time.monotonic() - start


def verdict(pipe: Any, rss_before: dict[str, float], bound_mib: float) -> dict[str, Any]:
    gauges, waited = settle(pipe)
    rss_after = rss_mib(pipe)
    growth = {k: round(rss_after.get(k, 0) - v, 1) for k, v in rss_before.items()}
    health = httpx.get(f"{pipe.url}/health", timeout=10)
    return {
        "healthy": health.status_code == 200,
        "stage_gauges_after": gauges,
        "gauges_zero_after_s": round(waited, 2),
        "rss_growth_mib": growth,
        "rss_within_bound": all(g <= bound_mib for g in growth.values()),
    }


# ---- the realtime wire, as a client speaks it ---------------------------------------------------
def _tone_b64(seconds: float, rate: int = 16_000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def _wav_uri(seconds: float, rate: int = 16_000) -> str:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(base64.b64decode(_tone_b64(seconds, rate)))
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


SESSION = {
    "model": MODEL,
    "modalities": ["audio", "text"],
    "input_audio_format": "pcm16",
    "output_audio_format": "pcm16",
    "sample_rate_hz": 16000,
    "turn_detection": None,
    "ref_audio": _wav_uri(1.0),
    "overlap_policy": "listen_only",
    "playback_commit_policy": "ack_only",
}


async def _until(ws: Any, type_: str, timeout_s: float) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == type_:
                return event
            if event["type"] == "error" and type_ != "error":
                raise RuntimeError(f"error event: {event['error']}")


async def realtime_turn(ws: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _tone_b64(1.3)}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    await ws.send(json.dumps({"type": "response.create"}))
    return await _until(ws, "response.done", timeout_s)


async def open_session(url: str, session: dict[str, Any] | None = None) -> Any:
    import websockets

    ws = await websockets.connect(
        url.replace("http", "ws") + "/v1/realtime?duplex=1", max_size=None, open_timeout=60
    )
    await ws.send(json.dumps({"type": "session.update", "session": session or SESSION}))
    await _until(ws, "session.updated", 60)
    return ws


# ---- runs -----------------------------------------------------------------------------------------
def fuzz_http(pipe: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """schemathesis against /openapi.json, negative then positive data, checking for any 5xx."""
    results = {}
    for mode in ("negative", "positive"):
        cmd = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{pipe.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--mode",
            mode,
            "--max-examples",
            str(args.max_examples),
            "--request-timeout",
            "120",
            "--seed",
            str(args.seed),
            "--continue-on-failure",
            "--report",
            "junit",
            "--report-dir",
            str(out / f"schemathesis-{mode}"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.max_seconds)
        (out / f"schemathesis-{mode}.txt").write_text(proc.stdout + proc.stderr)
        tail = proc.stdout.strip().splitlines()[-3:]
        results[mode] = {"exit_code": proc.returncode, "summary": tail}
    return {"schemathesis": results, "passed": all(r["exit_code"] == 0 for r in results.values())}


def _random_frame(rng: random.Random) -> str | bytes:
    kinds = [
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "response.create",
        "response.cancel",
        "session.close",
        "conversation.item.create",
        "bogus.type",
        None,
        7,
    ]
    choice = rng.randrange(8)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))  # binary frame
    if choice == 1:
        return "{not json" * rng.randrange(1, 4)
    event: dict[str, Any] = {"type": rng.choice(kinds)}
    if choice == 2:
        event["audio"] = rng.choice(
            ["%%%", base64.b64encode(b"\x01" * rng.choice([1, 3, 7])).decode(), 5, None]
        )
    elif choice == 3:
        event["session"] = {
            "temperature": rng.choice(["NaN", float("inf"), -1, "hot", None]),
            "sample_rate_hz": rng.choice([0, -8000, 10**12, "x", 16000]),
            "modalities": rng.choice([[], ["smell"], "audio", None]),
        }
    elif choice == 4:
        event["pad"] = "x" * rng.choice([10, 100_000, 2_000_000])
    elif choice == 5:
        event = [event]  # type: ignore[assignment]
    return json.dumps(event, allow_nan=True)


async def fuzz_ws(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    rng = random.Random(args.seed)
    codes: dict[str, int] = {}
    leaks: list[str] = []
    sent = reconnects = 0
    while sent < args.frames:
        reconnects += 1
        ws = await open_session(pipe.url)  # a live session, so frames reach the command handlers
        async with ws:
            try:
                while sent < args.frames:
                    await ws.send(_random_frame(rng))
                    sent += 1
                    with contextlib.suppress(TimeoutError):
                        while True:  # read whatever the frame provoked
                            event = json.loads(await asyncio.wait_for(ws.recv(), 0.05))
                            if event.get("type") == "error":
                                code = event["error"].get("code", "?")
                                codes[code] = codes.get(code, 0) + 1
                                if _REPR.search(event["error"].get("message", "")):
                                    leaks.append(event["error"]["message"])
            except websockets.ConnectionClosed:
                continue  # session.close or a policy close: open a new socket and go on
    return {
        "frames_sent": sent,
        "sockets": reconnects,
        "error_codes": codes,
        "internal_errors": codes.get("internal_error", 0),
        "repr_leaks": leaks[:5],
        "passed": codes.get("internal_error", 0) == 0 and not leaks,
    }


async def storm(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Chat streams and realtime sessions cut at random points, ``--concurrency`` at a time."""
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    counts = {"chat_cut": 0, "chat_5xx": 0, "realtime_cut": 0, "realtime_capacity_waits": 0}

    async def chat(client: httpx.AsyncClient) -> None:
        async with sem:
            body = {
                "model": MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
                "sampling_params_list": [{"max_tokens": 60, "ignore_eos": True}, {"max_tokens": 200}],
            }
            cut_after = rng.randrange(0, 12)
            async with client.stream("POST", f"{pipe.url}/v1/chat/completions", json=body, timeout=120) as r:
                if r.status_code >= 500:
                    counts["chat_5xx"] += 1
                    return
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n > cut_after:
                        break
            counts["chat_cut"] += 1

    rt_sem = asyncio.Semaphore(min(args.concurrency, args.session_limit))

    async def realtime() -> None:
        # A dropped session keeps its slot for the disconnect grace (30 s, resumable by design), so opens
        # beyond the session limit are refused as resource_exhausted until one is reaped: wait and retry.
        async with rt_sem:
            deadline = time.monotonic() + args.open_wait_s
            while True:
                try:
                    ws = await open_session(pipe.url)
                    break
                except RuntimeError as exc:
                    if "resource_exhausted" not in str(exc) or time.monotonic() > deadline:
                        raise
                    counts["realtime_capacity_waits"] += 1
                    await asyncio.sleep(1.0)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _tone_b64(1.3)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            await asyncio.sleep(rng.uniform(0.0, 2.0))
            ws.transport.abort()  # no close frame: the client just vanishes
            counts["realtime_cut"] += 1

    async with httpx.AsyncClient() as client:
        jobs = [chat(client) for _ in range(args.chat)] + [realtime() for _ in range(args.realtime)]
        rng.shuffle(jobs)
        await asyncio.gather(*jobs)
    # realtime sessions stay resumable for the disconnect grace before they are reaped
    await asyncio.sleep(args.grace_s)
    return {**counts, "passed": counts["chat_5xx"] == 0}


# Gateway series whose change over a soak must match what the clients counted.
_SOAK_SERIES = {
    "chat_200": r'minicpmo_gateway_requests_total\{route="/v1/chat/completions",status="200"\}',
    "chat_total": r'minicpmo_gateway_requests_total\{route="/v1/chat/completions",status="\d+"\}',
    "completed": r'minicpmo_realtime_responses_total\{status="completed"\}',
    "responses": r"minicpmo_realtime_responses_total\{[^}]*\}",
    "stage_errors": r"minicpmo_gateway_stage_errors_total\{[^}]*\}",
    "realtime_errors": r"minicpmo_realtime_errors_total\{[^}]*\}",
    "sessions_open": r"minicpmo_realtime_sessions",
}


def gateway_series(pipe: Any) -> dict[str, float]:
    """Sums of the :data:`_SOAK_SERIES` on the gateway's /metrics."""
    text = httpx.get(f"{pipe.url}/metrics", timeout=10).text
    return {
        key: sum(float(v) for v in re.findall(rf"^{pattern} ([0-9.e+-]+)$", text, re.M))
        for key, pattern in _SOAK_SERIES.items()
    }


async def soak(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--chat`` streaming chat clients and ``--duplex`` realtime sessions in a loop for ``--minutes``.

    Passes with zero errors, every gateway counter agreeing with what the clients saw, and the RSS of
    every process flat over the second half (sampled every ``--sample-s``)."""
    end = time.monotonic() + args.minutes * 60
    stats = {"chat_ok": 0, "chat_errors": 0, "turns_ok": 0, "turn_errors": 0}
    before = gateway_series(pipe)
    samples: list[tuple[float, dict[str, float]]] = []

    async def chat_loop(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        while time.monotonic() < end:
            lines = []
            async with client.stream("POST", f"{pipe.url}/v1/chat/completions", json=body, timeout=300) as r:
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
            ok = (
                r.status_code == 200
                and lines[-1:] == ["data: [DONE]"]
                and '"error"' not in "".join(lines[-2:])
            )
            stats["chat_ok" if ok else "chat_errors"] += 1

    # Each response ends after --response-units silent units at most (the gateway's default is 30): with
    # 8 sessions sharing a small CPU a 30-unit turn takes minutes, and the soak is about many turns.
    session = {**SESSION, "extra_body": {"max_response_units": args.response_units}}

    async def duplex_loop() -> None:
        ws = await open_session(pipe.url, session)
        try:
            while time.monotonic() < end:
                done = await realtime_turn(ws, 300)
                stats["turns_ok" if done["response"]["status"] == "completed" else "turn_errors"] += 1
        finally:
            await ws.send(json.dumps({"type": "session.close"}))
            await ws.close()

    async def sampler() -> None:
        started = time.monotonic()
        while time.monotonic() < end:
            samples.append((round(time.monotonic() - started, 1), rss_mib(pipe)))
            await asyncio.sleep(args.sample_s)

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(
            sampler(),
            *[chat_loop(client) for _ in range(args.chat)],
            *[duplex_loop() for _ in range(args.duplex)],
        )
    settle(pipe)
    after = gateway_series(pipe)
    delta = {k: after[k] - before[k] for k in _SOAK_SERIES if k != "sessions_open"}
    consistent = {
        "chat_200_equals_client_ok": delta["chat_200"] == stats["chat_ok"] + stats["chat_errors"],
        "chat_total_equals_client_count": delta["chat_total"] == stats["chat_ok"] + stats["chat_errors"],
        # a duplex model may also answer on its own, so completed can exceed the turns the clients drove
        "completed_covers_client_turns": delta["completed"] >= stats["turns_ok"],
        "every_response_completed": delta["responses"] == delta["completed"],
        "no_stage_errors": delta["stage_errors"] == 0,
        "no_realtime_errors": delta["realtime_errors"] == 0,
        "no_session_left_open": after["sessions_open"] == 0,
    }
    half = [rss for t, rss in samples if t >= args.minutes * 30]
    drift = {k: round(half[-1][k] - half[0][k], 1) for k in half[0]} if len(half) >= 2 else {}
    return {
        **stats,
        "metric_deltas": delta,
        "metrics_consistent": consistent,
        "rss_samples_mib": samples,
        "rss_second_half_drift_mib": drift,
        "passed": stats["chat_errors"] == 0
        and stats["turn_errors"] == 0
        and all(consistent.values())
        and all(abs(d) <= args.rss_bound_mib for d in drift.values()),
    }


def warm_up(pipe: Any, rounds: int = 2) -> None:
    """A few chat requests with speech and a realtime turn, so every stage has run once."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(rounds):
        httpx.post(f"{pipe.url}/v1/chat/completions", json=body, timeout=300).raise_for_status()

    async def turn() -> None:
        ws = await open_session(pipe.url)
        try:
            await realtime_turn(ws, 300)
        finally:
            await ws.send(json.dumps({"type": "session.close"}))
            await ws.close()

    asyncio.run(turn())


# ---- CLI ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n")[0])
    p.add_argument("run", choices=["fuzz-http", "fuzz-ws", "storm", "soak"])
    p.add_argument("--out", type=Path, default=Path("results/reliability"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-examples", type=int, default=100, help="fuzz-http: schemathesis examples per mode")
    p.add_argument("--max-seconds", type=float, default=1800, help="fuzz-http: time limit per mode")
    p.add_argument("--frames", type=int, default=1000, help="fuzz-ws: frames to send")
    p.add_argument("--chat", type=int, default=100, help="storm: chat streams to cut; soak: chat clients")
    p.add_argument("--realtime", type=int, default=20, help="storm: realtime sessions to drop")
    p.add_argument("--concurrency", type=int, default=8, help="storm: cuts in flight at once")
    p.add_argument(
        "--grace-s", type=float, default=35.0, help="storm: wait for the realtime disconnect grace"
    )
    p.add_argument("--session-limit", type=int, default=4, help="storm: the profile's max_realtime_sessions")
    p.add_argument(
        "--open-wait-s",
        type=float,
        default=600.0,
        help="storm: how long one realtime open may wait for a slot (dropped sessions hold theirs 30 s)",
    )
    p.add_argument("--duplex", type=int, default=8, help="soak: realtime clients")
    p.add_argument("--minutes", type=float, default=20.0, help="soak: duration")
    p.add_argument("--sample-s", type=float, default=30.0, help="soak: seconds between RSS samples")
    p.add_argument("--response-units", type=int, default=3, help="soak: max_response_units per session")
    p.add_argument(
        "--profile-overrides",
        default=None,
        help='JSON merged into the cpu profile, e.g. {"gateway": {"max_realtime_sessions": 8}}',
    )
    p.add_argument("--rss-bound-mib", type=float, default=200.0, help="allowed RSS growth per process")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pipe = start_pipeline(args.out, json.loads(args.profile_overrides) if args.profile_overrides else None)
    report: dict[str, Any] = {"run": args.run, "args": {k: str(v) for k, v in vars(args).items()}}
    started = time.monotonic()
    try:
        warm_up(pipe)  # first requests allocate work buffers and caches: not a leak, not in the RSS bound
        rss_before = rss_mib(pipe)
        report["rss_before_mib"] = rss_before
        if args.run == "fuzz-http":
            report["result"] = fuzz_http(pipe, args, args.out)
        else:
            runner = {"fuzz-ws": fuzz_ws, "storm": storm, "soak": soak}[args.run]
            report["result"] = asyncio.run(runner(pipe, args))
        report["after"] = verdict(pipe, rss_before, args.rss_bound_mib)
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        pipe.stop()
    after = report["after"]
    report["passed"] = bool(
        report["result"]["passed"]
        and after["healthy"]
        and not any(after["stage_gauges_after"].values())
        and after["rss_within_bound"]
    )
    (args.out / f"{args.run}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
