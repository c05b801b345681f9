"""Decode attention candidates over the paged cache, one layer's shapes, same run:

    python -m bench.thinker.attention [--device cuda] [--batches 1,8,16] [--contexts 512,4096]

* ``gather_sdpa``: the pure-torch path (gather each row's slots into ``[B, L]``, mask, SDPA);
* ``triton``: the paged kernel of ``services.common.kernels`` (no gather copy), with and without key
  splits (what the runner picks for the bucket, and 1);
* ``--rope``: rotary + attention as two kernels against the one-launch ``rope_attention`` at each of
  its launches, same conditions as ``--sweep``; ``--kv-cache fp8`` runs it on e4m3 caches (the launch
  to sweep for ``kv_cache: fp8``);
* ``--sweep``: the kernel's launch parameters (key block, warps, pipeline stages) at half, once, twice and
  four times the rule's splits, against the default launch, per point, under a decode step's conditions:
  each layer its own pages (read from HBM, not L2), the block table padded to the graph's context bucket.

Full-size head layout (32 query heads, 8 KV heads, head_dim 128, bf16 on CUDA), pages of 16 tokens
scattered over a pool; each variant is recorded into one CUDA graph of 36 calls (one per layer) so
launch cost counts as it does in the decode step. Prints JSON and a Markdown table (µs per layer).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.thinker import floor
from services.common.kernels import AttentionTiles, TorchOps, key_splits


def _graph_us(fn, device: torch.device, layers: int = 36, iters: int = 20) -> float:  # noqa: ANN001
    """µs per call of ``fn`` recorded ``layers`` times into one CUDA graph (one eager call on CPU)."""
    if device.type != "cuda":
        return 1e6 * floor.time_per_call(fn, device, 1)
    graph = floor.capture_graph(fn, device, layers)
    return 1e6 * floor.time_per_call(graph.replay, device, iters) / layers


def _case(device: torch.device, ops, b: int, ctx: int, splits_for) -> dict:  # noqa: ANN001
    """One (batch, context) point: every candidate on the same pages."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d, page = 32, 8, 128, 16
    blocks = -(-ctx // page)
    pool = b * blocks + 1
    k_cache = torch.randn(pool * page, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(pool - 1, device=device)[: b * blocks] + 1).view(b, blocks)
    pos = torch.full((b,), ctx - 1, dtype=torch.long, device=device)
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    offsets = torch.arange(blocks * page, device=device)
    gather = table.repeat_interleave(page, dim=1) * page + offsets % page
    mask = (offsets[None, :] <= pos[:, None])[:, None, None, :]

    def sdpa() -> torch.Tensor:
        kd = k_cache[gather].transpose(1, 2)
        vd = v_cache[gather].transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), kd, vd, attn_mask=mask)

    row: dict = {"batch": b, "context": ctx, "gather_sdpa_us": _graph_us(sdpa, device)}
    rows = torch.arange(b, device=device)
    ones = torch.ones(b, dtype=torch.long, device=device)
    sweep = {}
    for splits in (1, 2, 4, 8, 16):
        tiles = AttentionTiles(rows, ones, rows, pos, table, page, 1, splits)
        sweep[splits] = _graph_us(lambda t=tiles: ops.paged_attention(q, k_cache, v_cache, t), device)
    row["triton_splits"] = splits_for(b, ctx)
    row["triton_us"] = sweep[row["triton_splits"]]
    row["triton_nosplit_us"] = sweep[1]
    row["triton_sweep_us"] = sweep
    row["best_splits"] = min(sweep, key=sweep.get)
    tiles = AttentionTiles(rows, ones, rows, pos, table, page, 1, splits_for(b, ctx))
    ref = sdpa().reshape(b, hq, d).float()
    row["max_abs_diff"] = (ops.paged_attention(q, k_cache, v_cache, tiles).float() - ref).abs().max().item()
    return row


SWEEP = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]


def _sweep(device: torch.device, ops, b: int, ctx: int, splits_for, layers: int = 36) -> dict:  # noqa: ANN001
    """µs per layer of each launch in :data:`SWEEP` at half, once, twice and four times the rule's splits.

    As in a decode step: each of ``layers`` layers reads its own pages (a graph of all layers streams
    them from HBM; one shared cache would sit in the 50 MB L2 and flatter long contexts), the block table
    is padded to the graph's context bucket (the next power of two, at least 256) and the rule splits
    for that width, while the rows attend to ``ctx`` keys.
    """
    hq, hkv, d, page = 32, 8, 128, 16
    width = max(256, 1 << (ctx - 1).bit_length()) // page
    blocks = -(-ctx // page)
    pool = b * blocks + 1
    caches = [
        (
            torch.randn(pool * page, hkv, d, dtype=torch.bfloat16, device=device),
            torch.randn(pool * page, hkv, d, dtype=torch.bfloat16, device=device),
        )
        for _ in range(layers)
    ]
    table = torch.zeros((b, width), dtype=torch.long, device=device)
    table[:, :blocks] = (torch.randperm(pool - 1, device=device)[: b * blocks] + 1).view(b, blocks)
    pos = torch.full((b,), ctx - 1, dtype=torch.long, device=device)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=device)
    rows, ones = torch.arange(b, device=device), torch.ones(b, dtype=torch.long, device=device)
    rule = splits_for(b, width * page)

    def per_layer(tiles: AttentionTiles, launch: tuple[int, int, int] | None) -> float:
        def body() -> None:
            for k, v in caches:
                ops.paged_attention(q, k, v, tiles, launch)

        return _graph_us(body, device, layers=1) / layers

    results = []
    for splits in sorted({max(1, rule // 2), rule, min(16, 2 * rule), min(16, 4 * rule)}):
        tiles = AttentionTiles(rows, ones, rows, pos, table, page, 1, splits)
        results.append({"splits": splits, "launch": None, "us": per_layer(tiles, None)})
        results += [{"splits": splits, "launch": list(lc), "us": per_layer(tiles, lc)} for lc in SWEEP]
    default = next(r["us"] for r in results if r["splits"] == rule and r["launch"] is None)
    best = min(results, key=lambda r: r["us"])
    kv_bytes = 2 * b * ctx * hkv * d * 2  # K and V of every row, bf16: the layer's HBM floor
    return {"batch": b, "context": ctx, "table_width": width * page, "rule_splits": rule,
            "default_us": default, "best": best, "hbm_floor_us": 1e6 * kv_bytes / floor.copy_bandwidth(device),
            "all": results}  # fmt: skip


ROPE_SWEEP = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2)]


def _rope_sweep(  # noqa: PLR0913
    device: torch.device,
    b: int,
    ctx: int,
    splits_for,  # noqa: ANN001
    layers: int = 36,
    chunk: int = 0,
    split_factors: tuple[float, ...] = (1.0,),
    launches: list[tuple[int, int, int]] | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """µs per layer of rotary + attention of a decode step: the two kernels (``qk_rope_store`` then
    ``paged_attention``, default launches) against the one-launch ``rope_attention`` at each launch of
    :data:`ROPE_SWEEP`, under the conditions of :func:`_sweep` (own pages per layer, bucketed table,
    folded input norm: each row scaled by its residual row's 1/RMS).

    ``chunk``: the last ``chunk`` rows are one sequence's consecutive tokens (a packed prefill chunk,
    e.g. a duplex unit), whose one-launch programs compute the chunk's fresh keys one at a time; only the
    default launch is timed then. ``split_factors``: the one launch also at these multiples of the rule's
    key splits (keys ``"s=N (bn, w, st)"``); ``launches``: a subset of :data:`ROPE_SWEEP`; ``kv_dtype``:
    the caches' element type (``torch.float8_e4m3fn``: the thinker's ``kv_cache: fp8``).
    """
    from services.common.kernels.triton_ops import TritonOps as ops

    hq, hkv, d, page, hidden = 32, 8, 128, 16, 4096
    bf = torch.bfloat16
    width = max(256, 1 << (ctx - 1).bit_length()) // page
    blocks = -(-ctx // page)
    pool = b * blocks + 1
    caches = [
        (torch.randn(pool * page, hkv, d, dtype=bf, device=device).to(kv_dtype), torch.randn(pool * page, hkv, d, dtype=bf, device=device).to(kv_dtype))
        for _ in range(layers)
    ]  # fmt: skip
    table = torch.zeros((b, width), dtype=torch.long, device=device)
    table[:, :blocks] = (torch.randperm(pool - 1, device=device)[: b * blocks] + 1).view(b, blocks)
    pos = torch.full((b,), ctx - 1, dtype=torch.long, device=device)
    if chunk:
        first = b - chunk
        table[first:] = table[first]
        pos[first:] = torch.arange(ctx - chunk, ctx, device=device)
    slots = table.gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    qkv = torch.randn(b, (hq + 2 * hkv) * d, dtype=bf, device=device)
    x = torch.randn(b, hidden, dtype=bf, device=device)
    w = torch.ones(hq + hkv, d, dtype=bf, device=device)
    cos, sin = (torch.randn(ctx + 1, d, dtype=bf, device=device) for _ in range(2))
    rows, ones = torch.arange(b, device=device), torch.ones(b, dtype=torch.long, device=device)
    tiles = AttentionTiles(rows, ones, rows, pos, table, page, 1, splits_for(b, width * page))

    def per_layer(one_layer) -> float:  # noqa: ANN001
        def body() -> None:
            for k, v in caches:
                one_layer(k, v)

        return _graph_us(body, device, layers=1) / layers

    def two(k: torch.Tensor, v: torch.Tensor) -> None:
        q = ops.qk_rope_store(qkv, w, 1e-6, cos, sin, pos, slots, k, v, hq, hkv, (x, 1e-6))
        ops.paged_attention(q, k, v, tiles)

    result = {
        "batch": b,
        "context": ctx,
        "kv_cache": str(kv_dtype).removeprefix("torch."),
        "chunk": chunk,
        "splits": tiles.splits,
        "two_kernels_us": per_layer(two),
    }
    result["one_launch_us"] = {
        str(lc): per_layer(lambda k, v, lc=lc: ops.rope_attention(qkv, w, 1e-6, cos, sin, slots, k, v, tiles, hq, (x, 1e-6), lc))
        for lc in ([None] if chunk else launches or ROPE_SWEEP)
    }  # fmt: skip
    for f in split_factors if not chunk else ():
        n = max(1, round(tiles.splits * f))
        if n == tiles.splits:
            continue
        other = AttentionTiles(rows, ones, rows, pos, table, page, 1, n)
        for lc in launches or ROPE_SWEEP:
            result["one_launch_us"][f"s={n} {lc}"] = per_layer(
                lambda k, v, lc=lc, t=other: ops.rope_attention(qkv, w, 1e-6, cos, sin, slots, k, v, t, hq, (x, 1e-6), lc)
            )  # fmt: skip
    best = min(result["one_launch_us"], key=result["one_launch_us"].get)
    result["best"] = {"launch": best, "us": result["one_launch_us"][best]}
    return result


def run(device: torch.device, batches: list[int], contexts: list[int], splits_for) -> list[dict]:  # noqa: ANN001
    if device.type == "cuda":
        from services.common.kernels.triton_ops import TritonOps as ops
    else:
        ops = TorchOps
    return [_case(device, ops, b, ctx, splits_for) for ctx in contexts for b in batches]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.thinker.attention", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--sweep", action="store_true", help="sweep the Triton kernel's launch (CUDA only)")
    ap.add_argument(
        "--rope", action="store_true", help="rotary + attention: two kernels vs one launch (CUDA only)"
    )
    ap.add_argument(
        "--rope-chunk",
        type=int,
        default=0,
        help="with --rope, also each batch of more rows with its last N rows one packed prefill chunk",
    )
    ap.add_argument(
        "--rope-splits",
        default="1",
        help="with --rope, multiples of the rule's key splits to time the one launch at (e.g. 0.5,1,2)",
    )
    ap.add_argument(
        "--rope-launches",
        default="",
        help="with --rope, only these launches, as block_n:warps:stages[:v_early[:preload]],... (v_early 1: "
        "each block's values loaded beside its keys; preload 1: each split's first block loaded before the "
        "prologue; default: all of ROPE_SWEEP)",
    )
    ap.add_argument(
        "--kv-cache",
        choices=["bf16", "fp8"],
        default="bf16",
        help="with --rope, the caches' format (fp8: e4m3, the thinker's kv_cache: fp8)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8

    def splits_for(b: int, ctx: int) -> int:  # the runner's rule
        return key_splits(b, 8, ctx, sms)

    if args.rope:
        kv_dtype = torch.float8_e4m3fn if args.kv_cache == "fp8" else torch.bfloat16
        factors = tuple(float(x) for x in args.rope_splits.split(","))
        launches = [tuple(int(v) for v in x.split(":")) for x in args.rope_launches.split(",") if x] or None
        points = [
            _rope_sweep(
                device, b, ctx, splits_for, split_factors=factors, launches=launches, kv_dtype=kv_dtype
            )
            for ctx in (int(x) for x in args.contexts.split(","))
            for b in (int(x) for x in args.batches.split(","))
        ]
        print(json.dumps(points, indent=2))
        print(
            "\n| batch | context | splits | two kernels µs | one launch (64, 4, 2) µs | best one launch µs |"
        )
        print("|---:|---:|---:|---:|---:|---|")
        for p in points:
            print(
                f"| {p['batch']} | {p['context']} | {p['splits']} | {p['two_kernels_us']:.1f} "
                f"| {p['one_launch_us'].get(str((64, 4, 2)), float('nan')):.1f} "
                f"| {p['best']['launch']} {p['best']['us']:.1f} |"
            )
        n = args.rope_chunk
        mixed = [
            _rope_sweep(device, b, ctx, splits_for, chunk=n, kv_dtype=kv_dtype)
            for ctx in (int(x) for x in args.contexts.split(","))
            for b in (int(x) for x in args.batches.split(","))
            if n and b > n
        ]
        if mixed:
            print(json.dumps(mixed, indent=2))
            print(
                f"\n| batch (last {n} rows one chunk) | context | two kernels µs | one launch, default µs |"
            )
            print("|---:|---:|---:|---:|")
            for p in mixed:
                print(
                    f"| {p['batch']} | {p['context']} | {p['two_kernels_us']:.1f} | {p['best']['us']:.1f} |"
                )
        return 0
    if args.sweep:
        from services.common.kernels.triton_ops import TritonOps

        points = [
            _sweep(device, TritonOps, b, ctx, splits_for)
            for ctx in (int(x) for x in args.contexts.split(","))
            for b in (int(x) for x in args.batches.split(","))
        ]
        print(json.dumps(points, indent=2))
        print(
            "\n| batch | context (table) | rule's splits, default launch µs "
            "| best: splits, (block_n, warps, stages) µs | K/V at copy bandwidth µs |"
        )
        print("|---:|---:|---:|---|---:|")
        for p in points:
            bst = p["best"]
            print(
                f"| {p['batch']} | {p['context']} ({p['table_width']}) | {p['rule_splits']}, {p['default_us']:.1f} "
                f"| {bst['splits']}, {tuple(bst['launch']) if bst['launch'] else 'default'} {bst['us']:.1f} "
                f"| {p['hbm_floor_us']:.1f} |"
            )
        return 0
    rows = run(
        device,
        [int(x) for x in args.batches.split(",")],
        [int(x) for x in args.contexts.split(",")],
        splits_for,
    )
    print(json.dumps(rows, indent=2))
    print(
        "\n| batch | context | gather+SDPA µs | Triton paged µs (rule's splits) | Triton, no split µs "
        "| best splits (µs) | max abs diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        best = r["best_splits"]
        print(
            f"| {r['batch']} | {r['context']} | {r['gather_sdpa_us']:.1f} | {r['triton_us']:.1f} "
            f"({r['triton_splits']}) | {r['triton_nosplit_us']:.1f} | {best} ({r['triton_sweep_us'][best]:.1f}) "
            f"| {r['max_abs_diff']:.2e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
