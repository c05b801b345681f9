"""Restart time of every stage under load, through the embedded launcher's own supervision.

    python -m bench.restart --runs 2 --streams 4 --out results/restart
    python -m bench.restart --checkpoint DIR --deploy-config minicpmo_4_5 --device cuda --out results/restart

Starts ``python -m gateway.launcher`` on the tiny checkpoint on CPU (``--deploy-config cpu``, free stage
ports), keeps ``--streams`` streaming speech chats running in a loop (text + audio, so every stage
works), and then, ``--runs`` times per stage (code2wav, talker, thinker in turn), SIGKILLs that stage's
process and measures from the kill:

* ``restarted_s``: until the launcher has started it again (its log line ``restarted <child>``);
* ``serving_s``: until the new process answers its gRPC health check SERVING;
* ``served_s``: until a request that needs the stage (a short speech chat for code2wav and the talker, a
  text chat for the thinker), sent every 0.2 s, first succeeds: "serves again".

A kill waits until the stage has run the launcher's ``STABLE_S`` since its last start, so every kill is
a first crash (restarted at once) rather than a repeated one (backoff); a stage restarted with the killed
one (under MPS the launcher restarts every client of the MPS server, counted in ``group_restarts``)
waits for its own. ``--stages`` picks the stages to kill. Writes ``restart.json`` (every run, the worst
per stage, and the error that ended the run early, if one did: the launcher exited, or a stage was not
served again within ``--give-up-s``) under ``--out``; the exit status is 0 when every ``served_s`` is
within ``--bound-s`` (10). docs/reliability.md quotes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {
    "gateway": {"max_concurrent_requests": 32},
    "thinker": {"sampling": {"max_tokens": 16}},
    "talker": {"sampling": {"max_new_frames": 25}},
}
STAGES = ("code2wav", "talker", "thinker")


def _chat(speech: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 8,
    }
    body["modalities"] = ["text", "audio"] if speech else ["text"]
    return body


def _serving(port: int, stage: str) -> bool:
    from gateway.launcher import _stage_serving

    return _stage_serving(port, stage)


class Launcher:
    def __init__(self, out: Path, port: int, args: argparse.Namespace) -> None:
        from gateway.launcher import ensure_tiny_checkpoint

        self.out = out
        self.port = port
        self.log_path = out / "launcher.out"
        cmd = [
            sys.executable,
            "-m",
            "gateway.launcher",
            "--checkpoint",
            args.checkpoint or str(ensure_tiny_checkpoint()),
            "--deploy-config",
            args.deploy_config,
            "--device",
            args.device,
            "--stage-ports",
            "auto",
            "--port",
            str(port),
            "--log-dir",
            str(out / "logs"),
            "--stage-overrides",
            json.dumps(OVERRIDES),
        ]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        end = time.monotonic() + timeout_s
        while "[minicpmo-serve] ready" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"launcher not ready:\n{self.text()[-3000:]}")
            time.sleep(0.5)

    def children(self) -> dict[str, tuple[int, int]]:
        """child name -> (port, pid), the latest start or restart of each."""
        out: dict[str, tuple[int, int]] = {}
        for name, port, pid in re.findall(r"start (\S+) on \S+ port (\d+) pid (\d+)", self.text()):
            out[name] = (int(port), int(pid))
        for name, port, pid in re.findall(r"restarted (\S+) on port (\d+) pid (\d+)", self.text()):
            out[name] = (int(port), int(pid))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(30)


async def _load(url: str, streams: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    async def one() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while not stop.is_set():
                try:
                    async with client.stream("POST", url, json=_chat(True, True)) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                    if resp.status_code == 200:
                        counts["ok"] += 1
                        continue
                    counts["refused"] += 1  # a stage is down: 503 at once; do not spin on it
                except httpx.HTTPError:
                    counts["failed"] += 1
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one() for _ in range(streams)))


async def _measure(launcher: Launcher, stage: str, url: str, give_up_s: float) -> dict[str, float]:
    child = f"{stage}-0"
    port, pid = launcher.children()[child]
    restarts_before = launcher.text().count(f"restarted {child} ")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        while "served_s" not in out:
            now = time.monotonic() - killed
            if launcher.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited {now:.1f} s after {stage} was killed")
            if now > give_up_s:
                raise RuntimeError(f"{stage} not serving {give_up_s:g} s after the kill")
            if "restarted_s" not in out and launcher.text().count(f"restarted {child} ") > restarts_before:
                out["restarted_s"] = now
            if "restarted_s" in out and "serving_s" not in out and _serving(port, stage):
                out["serving_s"] = time.monotonic() - killed
            if "restarted_s" in out:
                sent = time.monotonic()
                try:
                    r = await client.post(url, json=_chat(stage != "thinker", False))
                except httpx.HTTPError:
                    pass  # not serving yet (the launcher's exit is checked above)
                else:
                    if r.status_code == 200:
                        out["served_s"] = sent - killed
                        break
            await asyncio.sleep(0.2)
    return {k: round(v, 2) for k, v in out.items()}


async def run(args: argparse.Namespace, launcher: Launcher) -> dict[str, Any]:
    from gateway.launcher import STABLE_S

    base = f"http://127.0.0.1:{launcher.port}"
    url = f"{base}/v1/chat/completions"
    stop = asyncio.Event()
    counts = {"ok": 0, "refused": 0, "failed": 0}
    load = asyncio.create_task(_load(url, args.streams, stop, counts))
    await asyncio.sleep(args.warm_s)
    started = dict.fromkeys(STAGES, time.monotonic() - STABLE_S)  # the first kill of each is a first crash
    runs: list[dict[str, Any]] = []
    error = None
    try:
        for _ in range(args.runs):
            for stage in args.stages:
                wait = started[stage] + STABLE_S + 1 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                before = {s: launcher.text().count(f"restarted {s}-0 ") for s in STAGES}
                result = await _measure(launcher, stage, url, args.give_up_s)
                for s in STAGES:  # the killed stage, and any restarted with it (an MPS group restart)
                    if launcher.text().count(f"restarted {s}-0 ") > before[s]:
                        started[s] = time.monotonic()
                result["stage"] = stage  # type: ignore[assignment]
                runs.append(result)
                print(json.dumps(result), flush=True)
                await asyncio.sleep(args.pause_s)
    except RuntimeError as exc:
        error = str(exc)
        print(f"bench.restart: {error}", flush=True)
    finally:
        stop.set()
        load.cancel()
    worst = {s: max((r["served_s"] for r in runs if r["stage"] == s), default=None) for s in args.stages}
    report = {"runs": runs, "worst_served_s": worst, "load": counts, "streams": args.streams}
    report["group_restarts"] = launcher.text().count("to restart them with it")
    if error is not None:
        report["error"] = error
    return report


def passed(report: dict[str, Any], bound_s: float) -> bool:
    """A run passes when it ended without an error, every killed stage has a figure within ``bound_s``,
    and the launcher exited 0."""
    figures = report["worst_served_s"].values()
    return (
        "error" not in report
        and all(v is not None and v <= bound_s for v in figures)
        and report.get("launcher_exit") == 0
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2, help="kills per stage")
    p.add_argument("--streams", type=int, default=4, help="streaming speech chats kept running")
    p.add_argument("--warm-s", type=float, default=10.0, help="load before the first kill")
    p.add_argument("--pause-s", type=float, default=3.0, help="between kills")
    p.add_argument("--bound-s", type=float, default=10.0)
    p.add_argument("--port", type=int, default=0, help="gateway port (0: a free one)")
    p.add_argument("--checkpoint", default=None, help="default: the launcher's cached tiny checkpoint")
    p.add_argument("--deploy-config", default="cpu", help="launcher profile (a GPU run: minicpmo_4_5)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="results/restart")
    p.add_argument(
        "--stages", nargs="+", default=list(STAGES), choices=STAGES, help="stages to kill, in turn"
    )
    p.add_argument(
        "--give-up-s", type=float, default=180.0, help="a kill not served again by then fails the run"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = args.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    launcher = Launcher(out, port, args)
    try:
        launcher.wait_ready()
        report = asyncio.run(run(args, launcher))
    finally:
        rc = launcher.stop()
    report["launcher_exit"] = rc
    report["passed"] = passed(report, args.bound_s)
    (out / "restart.json").write_text(json.dumps(report, indent=2))
    print(
        json.dumps({k: report.get(k) for k in ("worst_served_s", "load", "launcher_exit", "passed", "error")})
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
