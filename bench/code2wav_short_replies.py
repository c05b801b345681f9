"""Short replies' last windows on the code2wav stage as it serves:
``python -m bench.code2wav_short_replies --checkpoint DIR --device cuda``.

A reply of one or two windows ends before the flow caches reach their steady (trimmed) length, so its
last window has shapes no steady window has (a one-unit realtime answer, a chat reply of 50-59 codec
frames). This builds the stage's engine with the stage CLI's own defaults, starts it (the start-up
warm-up captures the CUDA graphs and freezes them, as before serving), then, for each reply shape and
batch size, runs the reply's windows through the runner and times its last window as the engine runs it
(:meth:`Code2WavRunner.run`, which splits a batch into the sizes its key was captured at), against the
same window on an eager runner (what a shape without a graph runs), and counts the graph sets' eager
calls during the timed runs (0: every last window replayed). Reported: the start-up warm-up's seconds and
graph count, and per case the median ms of each. Prints one JSON object, then a Markdown table. On CPU
(no graphs) it is a smoke test of the procedure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from services.code2wav.__main__ import build_parser
from services.code2wav.runner import Code2WavRunner, StreamState
from services.code2wav.service import build_engine, dit_choice
from services.common.checkpoint import CODEC_SILENCE_ID

# New codes per window of each reply; the last entry is its last window. A 10-code first window is what
# the profiles' talker sends (codec.first_window_frames); 15 more complete a realtime unit of 25.
REPLIES = {
    "one realtime unit, then the turn's end": (10, 15, 0),
    "chat reply of 50 frames": (10, 25, 15),
    "chat reply of 59 frames": (10, 25, 24),
    "reply of one 10-code window": (10, 7),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _windows(shape: tuple[int, ...], seed: int) -> list[tuple[list[int], bool]]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 6561, (sum(shape),), generator=gen).tolist()
    out, context, at = [], [CODEC_SILENCE_ID] * 3, 0
    for i, n in enumerate(shape):
        window = context + codes[at : at + n]
        out.append((window, i == len(shape) - 1))
        context, at = window[-3:], at + n
    return out


def _timed(runner: Code2WavRunner, states: list[StreamState], window: list[int], reps: int) -> float:
    """Median ms of the last window on copies of ``states`` (caches are immutable: each rep starts equal)."""
    device = runner.device
    times = []
    for _ in range(reps):
        items = [(replace(st), window, True) for st in states]
        _sync(device)
        t0 = time.perf_counter()
        runner.run(items)
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    stage_args = build_parser().parse_args(
        ["--checkpoint", args.checkpoint, "--device", args.device, "--max-batch", str(args.max_batch)]
    )
    engine, _ = build_engine(stage_args)
    t0 = time.perf_counter()
    await engine.start()
    warm_s = time.perf_counter() - t0
    try:
        return _cases(engine, stage_args, args, warm_s)
    finally:
        await engine.stop()


def _cases(
    engine: Any, stage_args: argparse.Namespace, args: argparse.Namespace, warm_s: float
) -> dict[str, Any]:
    """The timed cases, on the started engine's runner (its scheduler is idle: nothing is submitted)."""
    runner: Code2WavRunner = engine.runner
    prompt = engine._default_prompt
    assert prompt is not None
    dit, dit_dtype = dit_choice(stage_args)
    eager = Code2WavRunner(
        runner.model,
        n_timesteps=runner.n_timesteps,
        cache_dtype=runner.cache_dtype,
        nsf_noise=runner.nsf_noise,
        dit=dit,
        dit_dtype=dit_dtype,
    )
    graphs = runner.graph_sets
    cases = []
    for name, shape in REPLIES.items():
        for batch in args.batches:
            windows = _windows(shape, seed=len(cases))
            states = [runner.open_stream(f"{name}-{i}", prompt, i) for i in range(batch)]
            for window, _ in windows[:-1]:
                runner.run([(st, window, False) for st in states])
            last = windows[-1][0]
            _timed(runner, states, last, 1)  # first call of the shape: allocator, autotuning
            _timed(eager, states, last, 1)
            before = sum(g.eager_calls for g in graphs.values())
            runner.last_batch_sizes.clear()
            graphed_ms = _timed(runner, states, last, args.reps)
            split = runner.last_batch_sizes[: len(runner.last_batch_sizes) // args.reps]
            cases.append(
                {
                    "reply": name,
                    "codes": list(shape),
                    "batch": batch,
                    "as_run": split,
                    "engine_ms": round(graphed_ms, 2),
                    "eager_ms": round(_timed(eager, states, last, args.reps), 2),
                    "eager_calls": sum(g.eager_calls for g in graphs.values()) - before,
                }
            )
            print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    return {
        "device": str(runner.device),
        "gpu": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else None,
        "max_batch": args.max_batch,
        "warm_up_s": round(warm_s, 1),
        "graphs": {name: g.captured for name, g in graphs.items()},
        "cases": cases,
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"start-up warm-up {result['warm_up_s']} s, {sum(result['graphs'].values())} graphs "
        f"(max batch {result['max_batch']}, {result['gpu'] or result['device']})",
        "",
        "| reply (new codes per window) | batch | run as | engine ms | eager ms | eager calls |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        codes = " + ".join(str(n) for n in c["codes"])
        lines.append(
            f"| {c['reply']} ({codes}) | {c['batch']} | {' + '.join(map(str, c['as_run']))} | "
            f"{c['engine_ms']:.1f} | {c['eager_ms']:.1f} | {c['eager_calls']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.code2wav_short_replies", description=__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-batch", type=int, default=8, help="the stage's --max-batch (the profile's 8)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = asyncio.run(measure(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
