"""The decode step's weight GEMMs one shape at a time, in each way cuBLAS can be asked for them:

    python -m bench.thinker.gemm [--device cuda] [--batches 1,16]

A decode GEMM ``y = x @ W.T`` (``x [B, K]``, ``W [N, K]``, B ≤ 32) can be handed to cuBLAS as written
(``linear``: torch asks for ``W·xᵀ`` in column-major terms) or with the operands swapped (``swapped``:
``W @ xᵀ`` into ``yᵀ [N, B]``, so cuBLAS sees ``m = N`` rows of weights and ``n = B``); the two pick
different kernels from cuBLAS's heuristics. The accumulating forms the folded decode loop uses for the
O and down projections (``x += o @ W.T``, beta = 1) are timed the same two ways (``accumulate``,
``accumulate_swapped``: ``xᵀ += W @ oᵀ`` on the transposed view). The lm_head is also timed in vocabulary
chunks (``chunks=N``, swapped, into slices of one ``[V, B]`` output).

Each variant runs the shape over 36 distinct weight tensors (as the 36 layers do, so L2 never holds the
next one) in one CUDA graph; µs per call and the weight bytes' rate are printed as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from bench.thinker import floor

# The thinker's (Qwen3-8B) decode GEMMs: name -> (N, K, accumulates into the residual).
SHAPES: dict[str, tuple[int, int, bool]] = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, True),
    "gate_up": (24576, 4096, False),
    "down": (4096, 12288, True),
}
VOCAB = 151748


def _variants(w: torch.Tensor, batch: int, accumulate: bool) -> dict[str, Callable[[], object]]:
    """The ways of computing ``x @ w.T`` for one weight (closures over fresh inputs and outputs)."""
    n, k = w.shape
    x = torch.randn(batch, k, dtype=w.dtype, device=w.device)
    y = torch.zeros(batch, n, dtype=w.dtype, device=w.device)
    yt = torch.zeros(n, batch, dtype=w.dtype, device=w.device)
    if accumulate:
        return {
            "accumulate": lambda: y.addmm_(x, w.t()),
            "accumulate_swapped": lambda: y.t().addmm_(w, x.t()),
        }
    return {
        "linear": lambda: torch.matmul(x, w.t(), out=y),
        "swapped": lambda: torch.mm(w, x.t(), out=yt),
    }


def _lm_head_chunks(w: torch.Tensor, batch: int, chunks: int) -> Callable[[], object]:
    x = torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device)
    yt = torch.empty(w.shape[0], batch, dtype=w.dtype, device=w.device)
    bounds = [w.shape[0] * i // chunks for i in range(chunks + 1)]
    parts = [(w[a:b], yt[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]

    def run() -> None:
        for wc, out in parts:
            torch.mm(wc, x.t(), out=out)

    return run


def _time_us(fns: list[Callable[[], object]], device: torch.device) -> float:
    """µs per call of each of ``fns`` run in turn, all recorded into one CUDA graph."""

    def body() -> None:
        for fn in fns:
            fn()

    graph = floor.capture_graph(body, device)
    us = 1e6 * floor.time_per_call(graph.replay, device, 20) / len(fns)
    del graph
    return us


def run(
    device: torch.device, batches: list[int], layers: int, chunk_counts: list[int], gemms: list[str]
) -> list[dict]:
    dtype = torch.bfloat16
    rows = []
    for name, (n, k, acc) in SHAPES.items():
        if name not in gemms:
            continue
        weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(layers)]
        for b in batches:
            per_layer = [_variants(w, b, acc) for w in weights]
            for variant in per_layer[0]:
                us = _time_us([v[variant] for v in per_layer], device)
                rows.append(
                    {"gemm": name, "batch": b, "variant": variant, "us": us, "tb_s": n * k * 2 / us / 1e6}
                )
        del weights
    head = torch.randn(VOCAB, 4096, dtype=dtype, device=device)
    for b in batches if "lm_head" in gemms else ():
        variants: dict[str, Callable[[], object]] = {
            **_variants(head, b, False),
            **{f"chunks={c}": _lm_head_chunks(head, b, c) for c in chunk_counts},
        }
        for variant, fn in variants.items():
            us = _time_us([fn], device)
            rows.append(
                {
                    "gemm": "lm_head",
                    "batch": b,
                    "variant": variant,
                    "us": us,
                    "tb_s": head.numel() * 2 / us / 1e6,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thinker.gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers", type=int, default=36, help="distinct weights per shape (one per layer)")
    ap.add_argument("--lm-head-chunks", default="2,4,8")
    ap.add_argument("--gemms", default=",".join([*SHAPES, "lm_head"]), help="which GEMMs (comma-separated)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        print("bench.thinker.gemm times CUDA graphs: it needs a CUDA device")
        return 2
    rows = run(
        device,
        [int(x) for x in args.batches.split(",")],
        args.layers,
        [int(x) for x in args.lm_head_chunks.split(",") if x],
        args.gemms.split(","),
    )
    print(json.dumps(rows, indent=2))
    print("\n| GEMM | batch | variant | µs per call | weight TB/s |\n|---|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['gemm']} | {r['batch']} | {r['variant']} | {r['us']:.1f} | {r['tb_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
