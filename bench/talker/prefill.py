"""Talker batched prefill: eager forward vs the captured prefill graphs, same runner, same run.

    python -m bench.talker.prefill --checkpoint DIR --device cuda [--streams 1,4,8] [--rows 12,40]
        [--starts 0,900] [--repeats 30]

For each (streams S, condition rows R, start position P) the S slots are first filled to P rows, then
``TalkerRunner.prefill_batch`` feeds each of them R more rows, ``--repeats`` times (every slot's length
is put back after each call, so each call sees the same shapes). Reported per case: the median wall ms of
the eager forward (prefill graphs off) and of the graphed one (the bucket's replay, after
``warmup_prefill_graphs`` captured every bucket and froze the set), and whether the graphed call
replayed. Also: the capture time of the whole set and the graph pool's memory (``memory_reserved``
before and after the capture). On CPU only the eager column is measured.

Why: at 16 duplex sessions the talker's eager prefills of 1–8 new streams took 28–56 ms in front of every
stream's decode; this separates the prefill's own cost on an idle GPU from the contention of a full run.
Prints one JSON object, then a Markdown table (:func:`bench.output.publish`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.output import publish
from services.common.checkpoint import Checkpoint
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import TalkerRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(
    runner: TalkerRunner, streams: int, rows: int, start: int, repeats: int, seed: int = 0
) -> float:
    """Median wall ms of ``prefill_batch`` for ``streams`` slots at ``start``, each fed ``rows`` rows."""
    gen = torch.Generator().manual_seed(seed)
    hidden = runner.cfg.hidden_size
    conds = [torch.randn(rows, hidden, generator=gen).to(runner.device, runner.dtype) for _ in range(streams)]
    lengths = runner.cache.lengths
    saved = list(lengths)
    for slot in range(streams):
        lengths[slot] = start
    items = list(enumerate(conds))
    times = []
    try:
        for _ in range(repeats + 2):  # two untimed calls: first launches, allocator blocks
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.prefill_batch(items)
            _sync(runner.device)
            times.append((time.perf_counter() - t0) * 1000)
            for slot in range(streams):
                lengths[slot] = start
    finally:
        lengths[:] = saved
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="full-size random checkpoint for meaningful numbers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--rows", default="12,40", help="condition rows per stream")
    ap.add_argument("--starts", default="0,900", help="each stream's context length before the prefill")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the stage's dtypes
    model = MiniCPMTTS.from_checkpoint(Checkpoint(args.checkpoint), dtype=dtype, device=device)
    streams = [int(x) for x in args.streams.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    starts = [int(x) for x in args.starts.split(",")]
    runner = TalkerRunner(model, num_slots=max(streams), use_cuda_graphs=device.type == "cuda")
    graphs = runner.prefill_graphs
    runner.prefill_graphs = None  # the eager column first
    cases: list[dict[str, Any]] = []
    for s in streams:
        for r in rows_list:
            for p in starts:
                eager_ms = round(time_prefill(runner, s, r, p, args.repeats), 3)
                cases.append({"streams": s, "rows": r, "start": p, "eager_ms": eager_ms})
    result: dict[str, Any] = {"device": str(device), "cases": cases, "graphs": 0}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    if graphs is not None:
        runner.prefill_graphs = graphs
        _sync(device)
        reserved = torch.cuda.memory_reserved(device)
        t0 = time.perf_counter()
        result["graphs"] = runner.warmup_prefill_graphs(max(streams))
        result["capture_s"] = round(time.perf_counter() - t0, 2)
        result["graph_memory_mib"] = round((torch.cuda.memory_reserved(device) - reserved) / 2**20, 1)
        for case in cases:
            replays = graphs.replays
            case["graphed_ms"] = round(
                time_prefill(runner, case["streams"], case["rows"], case["start"], args.repeats), 3
            )
            case["replayed"] = graphs.replays > replays
    publish(result, markdown_table(result), args.out)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    head = (
        f"Talker prefill on {result.get('device_name', result['device'])}: {result['graphs']} prefill graphs"
    )
    if result["graphs"]:
        head += f", captured in {result['capture_s']} s, pool +{result['graph_memory_mib']} MiB"
    lines = [
        head,
        "",
        "| streams | rows | start | eager ms | graphed ms | replayed |",
        "|---:|---:|---:|---:|---:|:--|",
    ]
    for c in result["cases"]:
        graphed = c.get("graphed_ms", "—")
        lines.append(
            f"| {c['streams']} | {c['rows']} | {c['start']} | {c['eager_ms']} | {graphed} | {c.get('replayed', '—')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
