"""Skinny O-projection GEMM configs against cuBLAS, same run:

    python -m bench.thinker.skinny --device cuda [--rows 1,4,8,16] [--all]

For the O projection with its residual add (N 4096, K 4096: ``residual + h @ W.T``, the folded decode
loop's ``skinny.linear_accumulate``) at each row count:

* ``cublas``: ``torch.addmm(residual, h, W.T)``, what the step runs without the skinny kernel;
* every candidate config of :mod:`services.common.kernels.skinny` (column tile, K tile, split-K,
  warps, stages, ``tl.dot`` or broadcast-sum), its output checked against ``cublas`` (max abs error).

Each variant is 36 calls (one per layer) recorded into one CUDA graph, so launch gaps count as in the
step; the 36 calls cycle over enough copies of the weight (≥ 256 MiB) that none is served from L2.
Prints a Markdown table (µs per call, weight GB/s), the 36 layers' O GEMMs per arm, and the best config
of every row bucket as the ``SKINNY_CONFIGS`` literal to paste into ``skinny.py`` (or write them with
``--json-out`` for the thinker's ``kernel_table`` profile key). On CPU (``TRITON_INTERPRET=1``, fp32)
``--scale 32`` shrinks the shape to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch

from bench.thinker import floor

LAYERS = 36
# name -> (N, K): the full-size thinker's O projection, the one GEMM the engine runs skinny
SHAPES = {"o": (4096, 4096)}


def _graph_us(fn: Callable[[int], object], device: torch.device, iters: int = 20) -> float:
    """µs per call of ``fn(layer)`` over ``LAYERS`` layers in one CUDA graph (eager once per layer on CPU)."""

    def body() -> None:
        for i in range(LAYERS):
            fn(i)

    if device.type != "cuda":
        return 1e6 * floor.time_per_call(body, device, 1) / LAYERS
    graph = floor.capture_graph(body, device)
    us = 1e6 * floor.time_per_call(graph.replay, device, iters) / LAYERS
    del graph
    return us


def candidates(m: int, n: int, k: int, sms: int) -> list:  # (SkinnyConfig list: skinny imports triton)
    """~12-16 configs per shape: dot tiles at the split that first fills the SMs and twice it, broadcast
    tiles (≤ 8192 products per step) for M ≤ 4, and the default."""
    from services.common.kernels.skinny import SkinnyConfig, default_config, row_bucket

    def split_for(block_n: int, block_k: int) -> int:
        tiles = -(-n // block_n)
        s = 1
        while s < 16 and tiles * s < sms and k // (2 * s) >= block_k:
            s *= 2
        return s

    out = [default_config(m, n, k, sms)]
    for bn, bk, warps, stages in (
        (32, 256, 4, 3),
        (64, 128, 4, 4),
        (64, 256, 4, 3),
        (128, 128, 4, 3),
        (128, 128, 8, 4),
    ):
        s = split_for(bn, bk)
        for split in sorted({s, min(16, 2 * s)}):
            if k // split >= bk:
                out.append(SkinnyConfig(bn, bk, split, warps, stages, True))
    if m <= 4:
        rows = row_bucket(m)
        for bn, bk in ((16, 512), (32, 256), (64, 128), (16, 128), (32, 64)):
            if rows * bn * bk <= 8192:
                out.append(SkinnyConfig(bn, bk, split_for(bn, bk), 4, 3, False))
    return list(dict.fromkeys(out))  # unique, in order


def _case(device: torch.device, dtype: torch.dtype, m: int, name: str, scale: int, sms: int) -> dict:
    """One (rows, shape) point: cuBLAS and every candidate on the same inputs."""
    from services.common.kernels import skinny

    n, k = SHAPES[name]
    n, k = n // scale, k // scale
    gen = torch.Generator(device=device).manual_seed(m)
    wbytes = n * k * dtype.itemsize
    copies = max(1, min(LAYERS, -(-(256 << 20) // wbytes)))
    weights = [torch.randn(n, k, device=device, generator=gen, dtype=dtype) / k**0.5 for _ in range(copies)]
    h = torch.randn(m, k, device=device, generator=gen, dtype=dtype)
    residual = torch.randn(m, n, device=device, generator=gen, dtype=dtype)

    def w(i: int) -> torch.Tensor:
        return weights[i % copies]

    def cublas(i: int) -> torch.Tensor:
        return torch.addmm(residual, h, w(i).t())

    def fused(cfg) -> Callable[[int], torch.Tensor]:  # noqa: ANN001
        return lambda i: skinny.linear_accumulate(h, w(i), residual, config=cfg)

    row: dict = {"rows": m, "shape": name, "n": n, "k": k, "weight_bytes": wbytes}
    row["cublas_us"] = _graph_us(cublas, device)
    ref = cublas(0).float()
    sweep = []
    for cfg in candidates(m, n, k, sms):
        entry: dict = {"config": cfg}
        try:
            entry["max_abs_err"] = (fused(cfg)(0).float() - ref).abs().max().item()
            entry["us"] = _graph_us(fused(cfg), device)
        except Exception as exc:  # noqa: BLE001 (a config the compiler refuses, e.g. shared memory)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        sweep.append(entry)
    ok = [e for e in sweep if "us" in e]
    row["sweep"] = sweep
    row["best"] = min(ok, key=lambda e: e["us"]) if ok else None
    return row


def _gbs(row: dict, us: float) -> float:
    return row["weight_bytes"] / (us * 1e-6) / 1e9


def report(rows: list[dict], show_all: bool) -> str:
    lines = [
        "| rows | shape | cuBLAS addmm µs (GB/s) | skinny best µs (GB/s) | vs cuBLAS "
        "| max abs err | best (block_n, block_k, split_k, warps, stages, dot) |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        b = r["best"]
        if b is None:
            lines.append(f"| {r['rows']} | {r['shape']} | {r['cublas_us']:.1f} | – | – | – | – |")
            continue
        lines.append(
            f"| {r['rows']} | {r['shape']} | {r['cublas_us']:.1f} ({_gbs(r, r['cublas_us']):.0f}) "
            f"| {b['us']:.1f} ({_gbs(r, b['us']):.0f}) "
            f"| {r['cublas_us'] / b['us']:.2f}x | {b['max_abs_err']:.2e} | {tuple(b['config'])} |"
        )
    by_rows: dict[int, dict[str, float]] = {}
    for r in rows:
        step = by_rows.setdefault(r["rows"], {"cublas": 0.0, "skinny": 0.0})
        step["cublas"] += LAYERS * r["cublas_us"] / 1e3
        step["skinny"] += LAYERS * (r["best"]["us"] if r["best"] else r["cublas_us"]) / 1e3
    lines += ["", f"Per step ({LAYERS} layers' O projections):", ""]
    lines += ["| rows | cuBLAS addmm ms | skinny ms |", "|---:|---:|---:|"]
    lines += [f"| {m} | {s['cublas']:.3f} | {s['skinny']:.3f} |" for m, s in by_rows.items()]
    if show_all:
        lines += ["", "| rows | shape | config | µs | GB/s | max abs err |", "|---:|---|---|---:|---:|---:|"]
        for r in rows:
            for e in r["sweep"]:
                cfg = tuple(e["config"])
                if "us" in e:
                    lines.append(
                        f"| {r['rows']} | {r['shape']} | {cfg} | {e['us']:.1f} | {_gbs(r, e['us']):.0f} "
                        f"| {e['max_abs_err']:.2e} |"
                    )
                else:
                    lines.append(f"| {r['rows']} | {r['shape']} | {cfg} | – | – | {e['error']} |")
    return "\n".join(lines)


def config_literal(rows: list[dict]) -> str:
    """The best config per (row bucket, N, K) in ``SKINNY_CONFIGS``' literal form."""
    from services.common.kernels.skinny import row_bucket

    body = [
        f"    ({row_bucket(r['rows'])}, {r['n']}, {r['k']}): {r['best']['config']!r},  # {r['shape']}: "
        f"{r['best']['us']:.1f} µs vs cuBLAS {r['cublas_us']:.1f}"
        for r in rows
        if r["best"] is not None
    ]
    return "\n".join(["SKINNY_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {", *body, "}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thinker.skinny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts (M)")
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES)
    )
    ap.add_argument("--scale", type=int, default=1, help="divide N and K by this (CPU script checks)")
    ap.add_argument("--all", action="store_true", help="also print every config's time")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for m in args.rows.split(","):
            for name in args.shapes.split(","):
                rows.append(_case(device, dtype, int(m), name, args.scale, sms))
                best = rows[-1]["best"]
                print(
                    f"[skinny] rows {m} {name}: {len(rows[-1]['sweep'])} configs, best "
                    f"{best['us'] if best else float('nan'):.1f} µs, {time.perf_counter() - t0:.0f} s so far "
                    "(first run includes Triton compiles, later runs hit its disk cache)",
                    file=sys.stderr,
                    flush=True,
                )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2, default=lambda c: list(c))
    print(report(rows, args.all))
    print()
    print(config_literal(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
