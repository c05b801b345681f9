"""The fp8 side of the thinker bench: the fp8 matmul-stack floor and the fp8 GEMM config sweep.

* :func:`matmul_stack_ms`: the decode step's GEMMs alone (QKV, O, gate|up, down of every layer, then the
  lm_head) on ``[batch, hidden]`` activations through :func:`~services.common.kernels.fp8_gemm.fp8_linear`
  with the engine's own fp8 weights, recorded into one CUDA graph and replayed — the fp8 counterpart of
  :func:`bench.thinker.floor.matmul_stack_ms`, and what ``python -m bench.thinker --weights fp8`` reports
  the fp8 decode step against.
* :func:`tune`: for each distinct weight shape of the step and each row count, time a small grid of
  :class:`~services.common.kernels.fp8_gemm.Fp8Config` (the default first) and keep the fastest; the
  result goes into ``FP8_CONFIGS`` for the rest of the run and is printed as entries to paste into the
  built-in table.

``python -m bench.thinker.fp8 --device cuda`` runs the sweep alone on random weights of the full-size
shapes (or ``--shapes N:K,...``) and prints the table entries; its ``--json-out`` file is what the
thinker's ``fp8_table`` profile key (``--fp8-table``) loads at start, for a card or row buckets the
built-in table was not measured on. A candidate is timed only after its output matched the torch
reference (:func:`error_of`): a fast config that computes something else never wins.

``python -m bench.thinker.fp8 --device cuda --check [--table FILE]`` times nothing: it runs every entry of
the built-in table (and of FILE, loaded as the thinker would) at its bucket's row count and at a ragged
count inside the bucket, with the residual added in place as the step does, against the reference, and
exits 1 if any entry is off (:func:`check_table`). Seconds on a card; run it after adopting a sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from itertools import product
from typing import TYPE_CHECKING

import torch

from bench.thinker.floor import capture_graph, time_per_call
from services.common.kernels.fp8_quant import Fp8Weight, fp8_linear_ref, quantize_fp8
from services.common.kernels.tables import load_tables

if TYPE_CHECKING:
    from services.common.kernels.fp8_gemm import Fp8Config

# (N, K) of the full-size thinker's decode GEMMs: QKV, O, gate|up, down, lm_head.
FULL_SIZE_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151748, 4096))


def step_weights(runner) -> list[Fp8Weight]:  # noqa: ANN001 (ModelRunner)
    """The fp8 weights one decode step multiplies by, in order (after ``runner.quantize_weights()``)."""
    if runner.head_fp8 is None:
        raise ValueError("the runner's weights are not fp8 (quantize_weights first)")
    mats: list[Fp8Weight] = []
    for lay in runner.layers:
        mats += [lay.fp8.qkv, lay.fp8.o, lay.fp8.gate_up, lay.fp8.down]
    mats.append(runner.head_fp8)
    return mats


@torch.inference_mode()
def matmul_stack_ms(
    weights: list[Fp8Weight], batch: int, device: torch.device, dtype: torch.dtype, iters: int = 50
) -> float:
    """Milliseconds of one pass of ``fp8_linear(x, W)`` over ``weights`` for ``batch`` rows (one graph)."""
    from services.common.kernels.fp8_gemm import fp8_linear

    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype, device=device) for w in weights}
    outputs = [torch.empty(batch, w.shape[0], dtype=dtype, device=device) for w in weights]

    def body() -> None:
        for w, out in zip(weights, outputs, strict=True):
            fp8_linear(inputs[w.shape[1]], w, out=out)

    if device.type != "cuda":
        return 1e3 * time_per_call(body, device, max(1, iters // 25))
    graph = capture_graph(body, device)
    ms = 1e3 * time_per_call(graph.replay, device, iters)
    del graph
    return ms


def reference(runner, batches: list[int], device: torch.device) -> dict:  # noqa: ANN001 (ModelRunner)
    """The fp8 matmul stack per batch and the fp8 weight bytes a step streams."""
    weights = step_weights(runner)
    nbytes = sum(w.nbytes() for w in weights)
    stack = [{"batch": b, "ms": matmul_stack_ms(weights, b, device, runner.dtype)} for b in batches]
    for r in stack:
        r["weight_tb_s"] = nbytes / (r["ms"] / 1e3) / 1e12
    return {"matmul_stack": stack, "weight_bytes": nbytes}


def candidates(rows: int, n: int, k: int, sms: int = 132) -> list:
    """The sweep's configs for ``rows`` (up to the thinker's largest packed step, 128: the decode and
    packed-step layouts) and shape ``[n, k]``."""
    from services.common.kernels.fp8_gemm import SKINNY_ROWS, Fp8Config
    from services.thinker.runner import ModelRunner

    if rows > ModelRunner.PACKED_MAX_ROWS:
        return []
    if rows > SKINNY_ROWS:
        return packed_candidates(rows, n, k, sms)
    block_m = 16 if rows <= 16 else 32
    out = []
    # Small on purpose: every (block, split) pair is its own compile, and the sweep runs inside the
    # bench's time budget. Four warps and four stages measured as the skinny GEMMs' usual winners.
    for bn, bk, split in product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
        if k // split < 2 * bk or (bn == 32 and bk == 128):
            continue
        tiles = -(-n // bn)
        if split > 1 and tiles >= 2 * sms:  # the column tiles alone fill the card twice over
            continue
        if tiles * split < sms // 2:  # too few programs to stream from every SM
            continue
        out.append(Fp8Config(block_m, bn, bk, split, 4, 4))
    return out


def packed_candidates(rows: int, n: int, k: int, sms: int = 132) -> list:
    """Configs for a packed step of 33–128 rows (the thinker's 64- and 128-row graph buckets: decode rows
    with prefill chunks): one 64- or 128-row tile, 64/128-column tiles, K split or not. Why sweep them:
    the default there is the prefill layout (no split), which runs a 4096-column projection on 32–64
    programs, so fewer SMs than the card has stream its weights while each tile's MMA work grows."""
    from services.common.kernels.fp8_gemm import Fp8Config

    block_m, warps = (64, 4) if rows <= 64 else (128, 8)
    out = []
    for bn, bk, split in product((64, 128), (64, 128), (1, 2, 4, 8)):
        tiles = -(-n // bn)
        if k // split < 4 * bk or (split > 1 and tiles >= 2 * sms):
            continue
        out.append(Fp8Config(block_m, bn, bk, split, warps, 3))
    return out


TOLERANCE = 2e-2  # max |error| / max |reference|: bf16 rounding of the output is ~4e-3 of an element


def error_of(
    a: torch.Tensor,
    w: Fp8Weight,
    cfg: Fp8Config | None,
    residual: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
) -> float:
    """Max |fp8_linear - reference| / max |reference| of ``cfg`` on ``a`` (with ``residual`` added in place
    into a copy when given, as the step's O and down GEMMs do). ``ref``: that reference computed once by
    the caller (a sweep checks every candidate of a shape against one)."""
    from services.common.kernels.fp8_gemm import fp8_linear

    if ref is None:
        ref = fp8_linear_ref(a.float(), w, None, None if residual is None else residual.float())
    if residual is None:
        got = fp8_linear(a, w, config=cfg)
    else:
        got = residual.clone()
        fp8_linear(a, w, residual=got, out=got, config=cfg)
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.inference_mode()
def check_table(
    table: dict[tuple[int, int, int], Fp8Config], device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> list[dict]:
    """Each ``(bucket, N, K) -> config`` entry against the reference at ``bucket`` rows and at a ragged
    count inside the bucket (``bucket - 7`` above 8 rows), plain and with an in-place residual; rows with
    ``ok`` False are entries that compute something else."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for (bucket, n, k), cfg in sorted(table.items()):
        w = quantize_fp8(torch.randn(n, k, device=device, dtype=dtype, generator=gen) / 32)
        for m in sorted({bucket, bucket - 7 if bucket > 8 else bucket}):
            a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
            res = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
            err = max(error_of(a, w, cfg), error_of(a, w, cfg, res))
            out.append({"rows": m, "n": n, "k": k, "config": list(cfg), "error": err, "ok": err <= TOLERANCE})
    return out


def _eight(a: torch.Tensor, w: Fp8Weight, out: torch.Tensor, cfg: object) -> None:
    from services.common.kernels.fp8_gemm import fp8_linear

    for _ in range(8):
        fp8_linear(a, w, out=out, config=cfg)  # type: ignore[arg-type]


@torch.inference_mode()
def tune(
    shapes: list[tuple[int, int]], rows: list[int], device: torch.device, dtype: torch.dtype, iters: int = 30
) -> list[dict]:
    """Time the default and each candidate config per (rows, N, K); the fastest goes into ``FP8_CONFIGS``.

    Each timing replays a CUDA graph of 8 launches (the step's launches run back to back in a graph,
    so the per-launch overhead measured is the graph's, not the host's). A config that fails to compile
    or launch, or whose output is off the reference by more than :data:`TOLERANCE`, is skipped."""
    from services.common.kernels import fp8_gemm

    results = []
    for (n, k), m in product(shapes, rows):
        w = quantize_fp8(torch.randn(n, k, device=device, dtype=dtype) / 32)
        a = torch.randn(m, k, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        default = fp8_gemm.default_config(m, n, k, fp8_gemm._sm_count(device))
        timed: list[tuple[float, tuple]] = []
        ref = fp8_linear_ref(a.float(), w)
        for cfg in [default, *candidates(m, n, k, fp8_gemm._sm_count(device))]:
            try:
                err = error_of(a, w, cfg, ref=ref)
                if err > TOLERANCE:
                    print(f"fp8 tune: {m}x{n}x{k} {tuple(cfg)} skipped: error {err:.2e}", file=sys.stderr)
                    continue
                graph = capture_graph(partial(_eight, a, w, out, cfg), device)
                us = 1e6 * time_per_call(graph.replay, device, iters) / 8
                del graph
            except Exception as exc:  # noqa: BLE001 (a config the compiler or the card refuses)
                print(f"fp8 tune: {m}x{n}x{k} {tuple(cfg)} skipped: {type(exc).__name__}", file=sys.stderr)
                continue
            timed.append((us, tuple(cfg)))
        timed.sort()
        default_us = next((us for us, c in timed if c == tuple(default)), None)
        best = timed[0] if timed else None
        if best is not None:
            fp8_gemm.FP8_CONFIGS[(fp8_gemm.row_bucket(m), n, k)] = fp8_gemm.Fp8Config(*best[1])
        gbs = (n * k + m * k * 2) / (best[0] / 1e6) / 1e9 if best else None
        results.append(
            {"rows": m, "n": n, "k": k, "default": list(default), "default_us": default_us,
             "best": best and {"config": list(best[1]), "us": best[0]}, "best_gb_s": gbs,
             "timed": [{"config": list(c), "us": us} for us, c in timed]}
        )  # fmt: skip
    return results


def table_literal(results: list[dict]) -> str:
    """The sweep's winners as ``FP8_CONFIGS`` entries (Python source to paste into the built-in table)."""
    from services.common.kernels.fp8_gemm import row_bucket

    lines = []
    for r in results:
        if r["best"]:
            c = r["best"]["config"]
            lines.append(
                f"    ({row_bucket(r['rows'])}, {r['n']}, {r['k']}): Fp8Config(block_m={c[0]}, block_n={c[1]}, "
                f"block_k={c[2]}, split_k={c[3]}, num_warps={c[4]}, num_stages={c[5]}),  "
                f"# {r['best']['us']:.1f} us (default {r['default_us'] or float('nan'):.1f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thinker.fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,16", help="comma-separated row counts (≤ 128)")
    ap.add_argument("--shapes", default=None, help="N:K,... (default: the full-size thinker's GEMMs)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--check", action="store_true", help="check the table's configs against the reference")
    ap.add_argument(
        "--table", default=None, help="with --check: a --json-out file loaded over the built-in table"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.check:
        from services.common.kernels import fp8_gemm

        try:
            load_tables(None, args.table)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        checked = check_table(dict(fp8_gemm.FP8_CONFIGS), device)
        for r in checked:
            print(f"{r['rows']:4d} x {r['n']:6d} x {r['k']:5d} {tuple(r['config'])}: error {r['error']:.2e}"
                  f"{'' if r['ok'] else '  WRONG'}")  # fmt: skip
        bad = sum(not r["ok"] for r in checked)
        print(f"{len(checked) - bad} of {len(checked)} agree with the reference (tolerance {TOLERANCE:g})")
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(json.dumps(checked, indent=2) + "\n")
        return 1 if bad else 0
    shapes = (
        [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
        if args.shapes
        else list(FULL_SIZE_SHAPES)
    )
    rows = [int(r) for r in args.rows.split(",")]
    results = tune(shapes, rows, device, torch.bfloat16)  # type: ignore[arg-type]
    print(json.dumps(results, indent=2))
    print(table_literal(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
