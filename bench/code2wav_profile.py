"""Where a Code2Wav window's time goes: ``python -m bench.code2wav_profile --checkpoint DIR``.

The e2e timeline shows code2wav's first window as the largest share of time to first audio. This splits
one window (first window: 10 new codes + 3 silence; steady window: 25 new codes) at batch 1 and 8 into
its parts, timed with CUDA synchronisation around each part:

* ``encoder`` - token embedding, conformer encoder chunk and projection (one graph replay with the fused
  DiT, eager with the package DiT);
* ``solve`` - the 10-step CFM solve (fused DiT: one graph replay for the whole solve; package DiT: one
  DiT graph replay per step plus the eager glue);
* ``vocoder`` - HiFT f0 predictor, decoder, inverse STFT;
* ``host`` - the rest of ``run_batch`` (cache stacking/splitting, device->host copies).

Then one ``torch.profiler`` pass over a first window prints the top kernels and operators by device and
host time. Used to decide what to fuse or graph next; see BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from services.code2wav.service import build_engine
from services.common.checkpoint import CODEC_SILENCE_ID

CODES = [(i * 811) % 6561 for i in range(200)]


def _timed(
    fn: Callable[..., Any], name: str, acc: dict[str, list[float]], sync: Callable[[], None]
) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        acc[name].append(time.perf_counter() - t0)
        return out

    return wrapper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    p.add_argument("--tf32", choices=("on", "off"), default="on")
    p.add_argument("--dit", choices=("auto", "package", "fused"), default="auto", help="as the stage's --dit")
    p.add_argument("--dit-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler tables")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    eng_args = argparse.Namespace(
        checkpoint=args.checkpoint,
        device=args.device,
        max_batch=16,
        max_streams=64,
        cfm_steps=10,
        cache_dtype="float32",
        nsf_noise="on",
        cuda_graphs=args.cuda_graphs,
        voice_cache=4,
        tf32=args.tf32,
        dit=args.dit,
        dit_dtype=args.dit_dtype,
    )
    engine, _ = build_engine(eng_args)
    runner = engine.runner
    cuda = runner.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    prompt = engine.voices.encode_file(engine.default_voice)
    acc: dict[str, list[float]] = defaultdict(list)
    flow, voc = runner.flow, runner.vocoder
    originals = (flow.solver, voc.step, flow.encode)
    flow.solver = _timed(originals[0], "solve", acc, sync)
    voc.step = _timed(originals[1], "vocoder", acc, sync)
    flow.encode = _timed(originals[2], "encoder", acc, sync)

    first = [CODEC_SILENCE_ID] * 3 + CODES[:10]
    steady_new = CODES[10:35]
    report: dict[str, Any] = {
        "device": str(runner.device),
        "cuda_graphs": args.cuda_graphs,
        "tf32": args.tf32,
        "dit": runner.flow.dit_impl,
        "dit_dtype": str(runner.flow.compute_dtype).removeprefix("torch."),
        "parts_ms": {},
    }
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind in ("first", "steady"):
            totals: list[float] = []
            per_part: dict[str, list[float]] = defaultdict(list)
            for rep in range(args.repeats + 1):  # the first pass warms up (graph capture)
                states = [runner.open_stream(f"s{i}", prompt, seed=i) for i in range(batch)]
                if kind == "steady":
                    runner.run_batch(states, [first] * batch, False)
                    window = first[-3:] + steady_new
                else:
                    window = first
                acc.clear()
                sync()
                t0 = time.perf_counter()
                runner.run_batch(states, [window] * batch, False)
                sync()
                if rep > 0:
                    totals.append(time.perf_counter() - t0)
                    for k, v in acc.items():
                        per_part[k].append(sum(v))
            parts = {k: 1000 * statistics.median(v) for k, v in per_part.items()}
            total = 1000 * statistics.median(totals)
            parts["host"] = total - sum(parts.values())
            parts["total"] = total
            report["parts_ms"][f"{kind}_b{batch}"] = parts
            print(
                f"[code2wav-profile] DiT {report['dit']} {report['dit_dtype']}, tf32 {args.tf32}, "
                f"{kind} window, batch {batch}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()),
                flush=True,
            )

    if cuda and not args.no_profiler:
        from torch.profiler import ProfilerActivity, profile

        flow.solver, voc.step, flow.encode = originals
        state = runner.open_stream("prof", prompt, seed=1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.run_batch([state], [first], False)
            sync()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
        print(table, flush=True)
        report["top_device_ops"] = table
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(table_cpu, flush=True)
    lines = [
        "| window | batch | encoder ms | solve ms | vocoder ms | host ms | total ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, parts in report["parts_ms"].items():
        kind, b = key.split("_b")
        lines.append(
            f"| {kind} | {b} | {parts.get('encoder', 0):.1f} | {parts.get('solve', 0):.1f} | "
            f"{parts.get('vocoder', 0):.1f} | {parts['host']:.1f} | {parts['total']:.1f} |"
        )
    print("\n".join(lines), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
