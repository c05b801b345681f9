"""Where a talker decode step's device time goes: ``python -m bench.talker.profile --checkpoint DIR``.

Captures the decode+sample graph of each batch size in ``--batches`` (attention length bucket of
``--length``), replays it ``--replays`` times under ``torch.profiler`` and prints, per batch size, the
kernels launched per step and the top kernels by device time, grouped into families (GEMM, attention,
normalisation, elementwise, indexing, sampling/sort, copies) by name. A step that is a few hundred tiny
kernels is bound by per-kernel latency, not by bytes or FLOPs: that is what this shows and what
BENCHMARKS.md's Talker section reads from it. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from typing import Any

import torch

from services.common.checkpoint import Checkpoint
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import MIN_LENGTH_BUCKET, next_bucket

FAMILIES = (
    ("gemm", r"gemm|gemv|cutlass|sm90|nvjet|cublas|matmul"),
    ("attention", r"attention|flash|fmha|sdpa|softmax"),
    ("norm", r"norm|rsqrt"),
    ("sort/sampling", r"sort|topk|scan|cumsum|multinomial|argmax|radix|philox|rand"),
    ("index/scatter", r"index|scatter|gather|put"),
    ("copy/cat", r"copy|cat|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def profile_batch(engine: TalkerEngine, bsz: int, length: int, replays: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    n = min(next_bucket(bsz), runner.cache.num_slots)
    read_len = min(next_bucket(length, MIN_LENGTH_BUCKET), runner.context)
    with torch.inference_mode():
        graph = runner._graph(n, read_len)
        if graph is None:
            raise RuntimeError("talker graph capture failed")
        graph.ints[:, 2].zero_()
        graph.graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.graph.replay()
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time)  # µs
    total = sum(sum(v) for v in kernels.values()) / replays
    count = sum(len(v) for v in kernels.values()) / replays
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, times in kernels.items():
        fam = fams[family(name)]
        fam[0] += len(times) / replays
        fam[1] += sum(times) / replays
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "batch": bsz,
        "read_len": read_len,
        "kernels_per_step": round(count, 1),
        "kernel_us_per_step": round(total, 1),
        "families": {k: {"kernels": round(v[0], 1), "us": round(v[1], 1)} for k, v in fams.items()},
        "top": [
            {
                "kernel": name[:90],
                "per_step": round(len(t) / replays, 1),
                "us_per_step": round(sum(t) / replays, 1),
            }
            for name, t in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.talker.profile", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--length", type=int, default=300, help="attention length (bucketed)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("[talker-profile] skipped: no CUDA")
        return 0
    model = MiniCPMTTS.from_checkpoint(Checkpoint(args.checkpoint), dtype=torch.bfloat16, device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    engine = TalkerEngine(model, max_streams=max(batches), use_cuda_graphs=True)
    rows = [profile_batch(engine, b, args.length, args.replays) for b in batches]
    for r in rows:
        print(
            f"[talker-profile] batch {r['batch']} (length {r['read_len']}): {r['kernels_per_step']} kernels, "
            f"{r['kernel_us_per_step']} µs of kernel time per step"
        )
        print("| family | kernels / step | µs / step |\n|---|---:|---:|")
        for fam, v in sorted(r["families"].items(), key=lambda kv: -kv[1]["us"]):
            print(f"| {fam} | {v['kernels']} | {v['us']} |")
        print("| top kernel | per step | µs / step |\n|---|---:|---:|")
        for t in r["top"]:
            print(f"| `{t['kernel']}` | {t['per_step']} | {t['us_per_step']} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
