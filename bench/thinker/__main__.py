"""Thinker engine benchmark: ``python -m bench.thinker --checkpoint DIR --device cuda``.

Measures, on the checkpoint's ``llm.*`` weights (a full-size random checkpoint has the real shapes,
bytes and FLOPs), in one process and one run:

* decode throughput of our engine at each batch size (``--batches``, default 1,4,8): wall time of
  full engine steps (scheduler + forward + sampling + events), after warm-up, every row decoding;
* prefill throughput of one ``--prompt-len`` prompt (single engine step);
* the same two numbers for transformers ``generate()`` / forward on the *same* module and weights
  (decode ms/step = (t(n new tokens) - t(1 new token)) / (n - 1), so prefill is excluded);
* the HBM roofline of a decode step: bytes every step must read (all weights except the embedding
  table, plus the KV of the batch) / memory bandwidth (auto for H200/H100/A100, or ``--hbm-gbps``);
* the levers A/B in the same run (``--overlap on|off|both``): engine decode with and without the
  overlapped decode of :mod:`services.thinker.overlap` (same engine, same graphs), each row reporting
  engine ms, the replay alone, the floor and the ratios;
* the folded-norm loop A/B (``--norm-fold on|off|both``, :mod:`services.thinker.fused_forward`): the
  norm weights are folded once (one-way); the ``off`` arm runs the norm kernels on the folded weights,
  the same kernels and launches as an unfolded model; each arm recaptures the graphs;
* the one-launch rotary + attention A/B (``--rope-attention on|off|both``,
  :mod:`services.common.kernels.rope_attention`): each arm recaptures the graphs;
* the skinny O projection A/B (``--skinny-o on|off|both``, :mod:`services.common.kernels.skinny`): the
  folded loop's O GEMM + residual add as one Triton launch or cuBLAS's ``addmm_``; each arm recaptures;
* the same-run floors of :mod:`bench.thinker.floor`: the step's weight matmuls alone in one CUDA graph
  per batch (decode is reported as a ratio to it) and the dense matmul rate (prefill is reported as the
  share of it its matmul FLOPs reach);
* with ``--weights fp8``, after all of the above on the bf16 weights: the same engine's weights quantized
  to fp8 (:mod:`services.thinker.fp8_weights`; optionally the fp8 GEMM configs swept first,
  ``--fp8-tune``), its decode steps and prefill, and the fp8 matmul-stack floor (:mod:`bench.thinker.fp8`),
  each fp8 step reported against the fp8 floor and against the bf16 step of the same batch and overlap
  setting. The transformers baseline is skipped then (the module's bf16 projections are released);
* ``--fp8-table`` / ``--kernel-table``: a sweep's configs loaded over the built-in tables before the engine
  is built, as the thinker's profile keys load them, so two runs A/B a table at the step level (a decode
  step of 64 or 128 rows runs the GEMM shapes of the packed steps' graph buckets).

Prints one JSON object, then a Markdown table (the form BENCHMARKS.md records).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.thinker import floor
from services.common.checkpoint import Checkpoint
from services.common.kernels import rope_attention_enabled, skinny_o_enabled
from services.common.kernels.tables import load_tables
from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import Sampler, SamplingConfig
from services.thinker.scheduler import Sequence, WorkItem

# Peak HBM bandwidth (bytes/s) by device name fragment; override with --hbm-gbps.
# Extra max_tokens per decode row: earlier rows keep decoding while later rows are still in (chunked)
# prefill, and must not stop before the timed window ends. KV is reserved for it too.
DECODE_HEADROOM = 1024
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12, "L40S": 0.864e12, "4090": 1.008e12}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100_000, (n,), generator=g).tolist()


def hbm_bandwidth(device: torch.device, override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def weight_bytes_per_step(llm: torch.nn.Module) -> int:
    """Bytes a decode step reads from weights: everything except the embedding table (one row is read)."""
    embed = llm.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in llm.parameters())
    return total - embed.numel() * embed.element_size()


# --------------------------------------------------------------------------------------------- engine
def engine_decode(
    engine: ThinkerEngine, batch: int, context: int, steps: int, warmup: int, overlap: bool | None = None
) -> dict[str, Any]:
    """Timed decode steps of ``batch`` rows; ``overlap`` None keeps the engine's own setting."""
    if overlap is not None:
        engine.overlap = overlap
    seqs: list[Sequence] = []
    for i in range(batch):
        # Headroom: earlier rows keep decoding while later rows are still in (chunked) prefill.
        cfg = SamplingConfig(max_tokens=warmup + steps + DECODE_HEADROOM, ignore_eos=True, stop_token_ids=())
        seq = engine.open(lambda _ev: None)
        engine.submit(seq, WorkItem(_prompt(context, 100 + i), sampler=Sampler(cfg)))
        seqs.append(seq)
    while not all(s.wants_decode for s in seqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    chained0 = engine.chained_steps
    dt = _timed(lambda: [engine.step() for _ in range(steps)], engine.device)
    assert all(s.wants_decode for s in seqs), "a sequence stopped during the timed window"
    chained = engine.chained_steps - chained0
    replay_ms = graph_replay_ms(engine, batch, max(len(s.tokens) for s in seqs) + 1)
    # Greedy tokens of the warm-up and timed steps: two arms that should compute the same function
    # (a launch change meant to be exact, the same code on two cards) must print the same digest.
    digest = hashlib.sha256(json.dumps([s.tokens[context:] for s in seqs]).encode()).hexdigest()[:16]
    for s in seqs:
        engine.close(s)
    engine.step()
    return {
        "batch": batch,
        "weights": engine.runner.weights,
        "overlap": engine.overlap,
        "norm_fold": engine.runner.norm_fold,
        "rope_attention": engine.runner.fused.rope_attention,
        "skinny_o": engine.runner.fused.skinny_o,
        "chained_steps": chained,
        "graph_replay_ms": replay_ms,
        "ms_per_step": 1e3 * dt / steps,
        "tok_s_per_stream": steps / dt,
        "tok_s_total": batch * steps / dt,
        "tokens_digest": digest,
    }


def graph_replay_ms(engine: ThinkerEngine, batch: int, context: int, iters: int = 20) -> float | None:
    """GPU time of the last decode step's graph alone (replayed on its inputs as they stand: the same KV
    slots are rewritten with the same values), so engine ms - this = host work not overlapped."""
    graph = engine.runner._graph_for(batch, context, capture=False) if engine.runner.use_cuda_graphs else None
    if graph is None or engine.device.type != "cuda":
        return None
    return 1e3 * floor.time_per_call(graph._replay, engine.device, iters)


def profile_step(engine: ThinkerEngine, batch: int, context: int, rows: int = 25) -> str | None:
    """Top GPU kernels of one decode step's body, run eagerly on the graph's own inputs (same kernels as
    the replay; launch gaps excluded), from the torch profiler; None without a captured graph."""
    graph = engine.runner._graph_for(batch, context, capture=False) if engine.runner.use_cuda_graphs else None
    if graph is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    args = (graph.ids, graph.pos, graph.write, graph.table, graph.embeds, graph.use_embeds)
    with torch.inference_mode():
        engine.runner.decode_forward_static(*args)
        torch.cuda.synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.runner.decode_forward_static(*args)
            torch.cuda.synchronize(engine.device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def engine_prefill(engine: ThinkerEngine, prompt_len: int, iters: int) -> dict[str, float]:
    times = []
    for i in range(iters + 1):  # the first run warms up kernels for this shape
        seq = engine.open(lambda _ev: None)
        cfg = SamplingConfig(max_tokens=1, ignore_eos=True, stop_token_ids=())
        engine.submit(seq, WorkItem(_prompt(prompt_len, 7 + i), sampler=Sampler(cfg)))
        t = _timed(engine.run_until_idle, engine.device)
        if i:
            times.append(t)
    t = statistics.median(times)
    # Every iteration too: the median of a few hides whether a slow figure is one outlier or a slow run.
    return {
        "prompt_len": prompt_len,
        "ms": 1e3 * t,
        "tok_s": prompt_len / t,
        "times_ms": [1e3 * x for x in times],
    }


# --------------------------------------------------------------------------------------- transformers
@torch.inference_mode()
def hf_decode(
    llm: torch.nn.Module, batch: int, context: int, steps: int, device: torch.device
) -> dict[str, float]:
    ids = torch.tensor([_prompt(context, 100 + i) for i in range(batch)], device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> None:
        llm.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    gen(2)  # warm-up
    t1 = _timed(lambda: gen(1), device)
    tn = _timed(lambda: gen(steps + 1), device)
    dt = max(tn - t1, 1e-9)
    return {"batch": batch, "ms_per_step": 1e3 * dt / steps, "tok_s_per_stream": steps / dt}


@torch.inference_mode()
def hf_prefill(llm: torch.nn.Module, prompt_len: int, iters: int, device: torch.device) -> dict[str, float]:
    ids = torch.tensor([_prompt(prompt_len, 7)], device=device)
    llm(input_ids=ids, use_cache=True)
    t = statistics.median(_timed(lambda: llm(input_ids=ids, use_cache=True), device) for _ in range(iters))
    return {"prompt_len": prompt_len, "ms": 1e3 * t, "tok_s": prompt_len / t}


# ---------------------------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Thinker engine benchmark — {result['device_name']}, {result['dtype']}, "
        f"context {result['context_len']} tokens, CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, "
        f"torch.compile {'on' if result.get('compiled_layers') else 'off'}, kernels {result.get('kernels', 'torch')}, "
        f"KV cache {result.get('kv_cache', 'bf16')}",
        "",
        "| batch | engine ms/step | engine tok/s per stream | engine tok/s total | transformers ms/step "
        "| speed-up | roofline ms/step | % of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    hf = {r["batch"]: r for r in result.get("transformers_decode", [])}
    for r in result["engine_decode"]:
        h = hf.get(r["batch"])
        roof = r.get("roofline_ms")
        label = (
            f"{r['batch']}{' (overlap)' if r.get('overlap') else ''}"
            f"{' (folded)' if r.get('norm_fold') else ''}{' (rope+attn)' if r.get('rope_attention') else ''}"
        )
        lines.append(
            f"| {label} | {r['ms_per_step']:.2f} | {r['tok_s_per_stream']:.1f} | {r['tok_s_total']:.1f} "
            f"| {h['ms_per_step']:.2f} | {h['ms_per_step'] / r['ms_per_step']:.1f}x "
            if h
            else f"| {label} | {r['ms_per_step']:.2f} | {r['tok_s_per_stream']:.1f} | {r['tok_s_total']:.1f} | – | – "
        )
        lines[-1] += f"| {roof:.2f} | {100 * roof / r['ms_per_step']:.0f}% |" if roof else "| – | – |"
    ref = result.get("floor")
    if ref:
        stack = {r["batch"]: r["ms"] for r in ref["matmul_stack"]}
        lines += [
            "",
            f"Same-run floors: dense {result['dtype']} matmul {ref['matmul_tflop_s']:.0f} TFLOP/s, copy "
            f"{ref['copy_tb_s']:.2f} TB/s, weights {ref['weight_bytes'] / 1e9:.2f} GB per step.",
            "",
            "| batch | overlap | folded norms | rope+attention | skinny O | engine ms/step | graph replay ms "
            "| matmul-stack floor ms | ratio | replay ratio | floor weight TB/s "
            "| floor, lm_head swapped ms | ratio to it |",
            "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["engine_decode"]:
            f = stack.get(r["batch"])
            if f:
                tb = next(x["weight_tb_s"] for x in ref["matmul_stack"] if x["batch"] == r["batch"])
                rep = r.get("graph_replay_ms")
                over = "on" if r.get("overlap") else "off"
                fold = "on" if r.get("norm_fold") else "off"
                ra = "on" if r.get("rope_attention") else "off"
                so = "on" if r.get("skinny_o") else "off"
                lines.append(
                    f"| {r['batch']} | {over} | {fold} | {ra} | {so} | {r['ms_per_step']:.2f} | {'–' if rep is None else f'{rep:.2f}'} "
                    f"| {f:.2f} | {r['ms_per_step'] / f:.3f}x | {'–' if rep is None else f'{rep / f:.3f}x'} "
                    f"| {tb:.2f} | {r.get('floor_swapped_head_ms', float('nan')):.2f} "
                    f"| {r.get('floor_swapped_head_ratio', float('nan')):.3f}x |"
                )
    p, hp = result["engine_prefill"], result.get("transformers_prefill")
    lines += [
        "",
        "| prefill | tokens | engine ms | engine tok/s | transformers ms | transformers tok/s |",
        "|---|---:|---:|---:|---:|---:|",
        f"| one prompt | {p['prompt_len']} | {p['ms']:.1f} | {p['tok_s']:.0f} | "
        + (f"{hp['ms']:.1f} | {hp['tok_s']:.0f} |" if hp else "– | – |"),
    ]
    if "matmul_share" in p:
        lines += [
            "",
            f"Prefill: {p['tflop'] * 1e3:.2f} GFLOP of matmuls in {p['ms']:.1f} ms = "
            f"{p['tflop_s']:.0f} TFLOP/s, {100 * p['matmul_share']:.0f}% of the same-run matmul rate.",
        ]
    if p.get("times_ms"):
        lines += ["", "Prefill iterations (ms): " + ", ".join(f"{x:.1f}" for x in p["times_ms"])]
    return "\n".join(lines)


def fp8_arm(
    engine: ThinkerEngine,
    args: argparse.Namespace,
    batches: list[int],
    bf16_decode: list[dict[str, Any]],
    bandwidth: float | None,
) -> dict[str, Any]:
    """The fp8 half of ``--weights fp8``: quantize the engine's weights (levers back to their defaults),
    optionally sweep the fp8 GEMM configs, then decode per batch and overlap setting, one prefill, and
    the fp8 matmul-stack floor; each step as a ratio to that floor and to the bf16 step of its arm."""
    from bench.thinker import fp8 as fp8_bench

    runner = engine.runner
    runner.drop_graphs()
    runner.set_norm_fold(None)
    runner.fused.rope_attention = rope_attention_enabled(None)
    runner.fused.skinny_o = skinny_o_enabled(None)
    t0 = time.perf_counter()
    runner.quantize_weights()
    out: dict[str, Any] = {"quantize_s": time.perf_counter() - t0}
    # The torch kernels (CPU) run the fp8 round trip of the weights through the bf16 GEMMs: no fp8
    # GEMM to sweep or to take a floor of.
    weights = fp8_bench.step_weights(runner) if runner.head_fp8 is not None else []
    if args.fp8_tune and engine.device.type == "cuda" and weights:
        shapes = sorted({tuple(w.shape) for w in weights})
        out["tune"] = fp8_bench.tune(shapes, batches, engine.device, runner.dtype)  # type: ignore[arg-type]
        print("fp8 GEMM sweep (FP8_CONFIGS entries):", file=sys.stderr)
        print(fp8_bench.table_literal(out["tune"]), file=sys.stderr)
    nbytes = sum(w.nbytes() for w in weights) or weight_bytes_per_step(runner.llm)
    decode = []
    for b in batches:
        for over in ARMS[args.overlap]:
            r = engine_decode(engine, b, args.context_len, args.decode_steps, args.warmup_steps, over)
            mean_ctx = args.context_len + args.warmup_steps + args.decode_steps / 2
            step_bytes = nbytes + b * mean_ctx * engine.layout.bytes_per_token
            r["bytes_per_step"] = step_bytes
            r["roofline_ms"] = 1e3 * step_bytes / bandwidth if bandwidth else None
            same = [
                x for x in bf16_decode if x["batch"] == b and x["overlap"] == r["overlap"] and x["norm_fold"] == r["norm_fold"]
            ]  # fmt: skip
            if same:
                r["bf16_ms_per_step"] = same[-1]["ms_per_step"]
                r["bf16_ratio"] = r["ms_per_step"] / same[-1]["ms_per_step"]
            decode.append(r)
    out["engine_decode"] = decode
    if args.profile and engine.device.type == "cuda":
        ctx = args.context_len + args.warmup_steps + args.decode_steps + 1
        for b in sorted({batches[0], batches[-1]}):
            print(
                f"torch profiler, fp8 weights, 3 decode-step bodies at batch {b} (eager, the graph's kernels):"
            )
            print(profile_step(engine, b, ctx))
    out["engine_prefill"] = engine_prefill(engine, args.prompt_len, args.prefill_iters)
    if not args.no_floor and weights:
        ref = fp8_bench.reference(runner, batches, engine.device)
        out["floor"] = ref
        stack = {x["batch"]: x["ms"] for x in ref["matmul_stack"]}
        for r in decode:
            r["floor_ms"] = stack[r["batch"]]
            r["floor_ratio"] = r["ms_per_step"] / stack[r["batch"]]
            if r.get("graph_replay_ms") is not None:
                r["replay_floor_ratio"] = r["graph_replay_ms"] / stack[r["batch"]]
    return out


def fp8_markdown(fp8: dict[str, Any]) -> str:
    """The fp8 arm as a table: fp8 step, its floor and ratio, beside the bf16 step of the same arm."""
    ref = fp8.get("floor") or {"matmul_stack": [], "weight_bytes": 0}
    tb = {x["batch"]: x["weight_tb_s"] for x in ref["matmul_stack"]}
    lines = [
        f"fp8 weights (e4m3, per-channel scales; {ref['weight_bytes'] / 1e9:.2f} GB of GEMM weights per step), "
        f"quantized in {fp8['quantize_s']:.1f} s, same run as the bf16 figures above:",
        "",
        "| batch | overlap | bf16 ms/step | fp8 ms/step | fp8 / bf16 | fp8 graph replay ms "
        "| fp8 matmul-stack floor ms | ratio | replay ratio | floor weight TB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(v: float | None, fmt: str, unit: str = "") -> str:
        return "–" if v is None else format(v, fmt) + unit

    for r in fp8["engine_decode"]:
        lines.append(
            f"| {r['batch']} | {'on' if r.get('overlap') else 'off'} | {num(r.get('bf16_ms_per_step'), '.2f')} "
            f"| {r['ms_per_step']:.2f} | {num(r.get('bf16_ratio'), '.3f', 'x')} | {num(r.get('graph_replay_ms'), '.2f')} "
            f"| {num(r.get('floor_ms'), '.2f')} | {num(r.get('floor_ratio'), '.3f', 'x')} "
            f"| {num(r.get('replay_floor_ratio'), '.3f', 'x')} | {num(tb.get(r['batch']), '.2f')} |"
        )
    p = fp8["engine_prefill"]
    lines += ["", f"fp8 prefill: {p['prompt_len']} tokens in {p['ms']:.1f} ms ({p['tok_s']:.0f} tok/s)."]
    return "\n".join(lines)


# A lever's arms: on, off, both (an A/B in one run; graph levers recapture per arm), or the engine's
# default (None: its device rule decides).
ARMS: dict[str, list[bool | None]] = {"on": [True], "off": [False], "both": [False, True], "default": [None]}


def lever(ap: argparse.ArgumentParser, flag: str, default: str, what: str) -> None:
    """An ``on|off|both|default`` option for one lever of the engine (see :data:`ARMS`)."""
    ap.add_argument(flag, choices=list(ARMS), default=default, help=f"{what}: on, off, both (A/B) or default")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.thinker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    ap.add_argument("--batches", default="1,4,8,16", help="comma-separated decode batch sizes")
    ap.add_argument("--context-len", type=int, default=512, help="prompt tokens before the timed decode")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill benchmark prompt length")
    ap.add_argument("--prefill-iters", type=int, default=5)
    ap.add_argument("--hf-decode-steps", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-layer blocks")
    ap.add_argument("--kv-budget-gb", type=float, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth for the roofline (GB/s)")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one decode step (CUDA)")
    ap.add_argument("--no-floor", action="store_true", help="skip the matmul-stack / matmul-rate floors")
    ap.add_argument("--kernels", default=None, help="thinker kernel backend: torch | triton | auto")
    lever(
        ap,
        "--overlap",
        "both",
        "overlapped decode (services.thinker.overlap); both: A/B per batch, same engine",
    )
    lever(ap, "--norm-fold", "default", "folded-norm decode loop (Triton kernels; on by default on CUDA)")
    lever(
        ap,
        "--rope-attention",
        "default",
        "rotary + K/V write + attention in one launch (Triton; on by default)",
    )
    lever(ap, "--skinny-o", "default", "the O projection + residual add as one skinny Triton launch")
    ap.add_argument(
        "--weights",
        choices=["bf16", "fp8"],
        default="bf16",
        help="fp8: after the bf16 figures, quantize the same engine's weights to fp8 and measure again",
    )
    ap.add_argument("--fp8-tune", action="store_true", help="sweep the fp8 GEMM configs before the fp8 arm")
    ap.add_argument(
        "--kv-cache",
        choices=["bf16", "fp8"],
        default="bf16",
        help="the engine's KV cache for every arm (fp8: e4m3; compare two runs for its effect)",
    )
    ap.add_argument(
        "--kernel-table",
        default=None,
        metavar="JSON",
        help="skinny-GEMM configs of a `bench.thinker.skinny --json-out` sweep, loaded before the engine as "
        "the thinker's profile key kernel_table loads them",
    )
    ap.add_argument(
        "--fp8-table",
        default=None,
        metavar="JSON",
        help="fp8 GEMM configs of a `bench.thinker.fp8 --json-out` sweep (profile key fp8_table): an A/B of a "
        "sweep's winners, or of the built-in table against the defaults, at the step level",
    )
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    try:
        tables = load_tables(args.kernel_table, args.fp8_table)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    ckpt = Checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    llm = build_qwen3_llm(
        ckpt.config,
        ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=dtype, device=device),
        dtype,
        str(device),
    )
    load_s = time.perf_counter() - t0
    batches = [int(b) for b in args.batches.split(",") if b]
    max_tokens_needed = args.context_len + args.warmup_steps + args.decode_steps + DECODE_HEADROOM
    cfg = llm.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
    # Enough KV for the largest batch (plus the prefill prompt), not "all free memory": the transformers
    # baseline runs afterwards in the same process and needs room for its own cache.
    needed = max(batches) * max_tokens_needed + args.prompt_len + 64 * 16
    budget = int(args.kv_budget_gb * 2**30) if args.kv_budget_gb else int(1.25 * needed * bytes_per_token)
    engine = ThinkerEngine(
        llm,
        EngineConfig(
            max_num_seqs=max(batches),
            max_step_tokens=max(512, args.prompt_len, args.context_len),
            kv_budget_bytes=budget,
            use_cuda_graphs=not args.no_cuda_graphs,
            compile_layers=args.compile,
            # The engine's compute is measured: prompts repeated by the profiler pass must not hit a cache.
            prefix_caching=False,
            kv_cache=args.kv_cache,
        ),
        device,
    )
    engine.runner.set_kernels(args.kernels)
    if engine.cache.capacity_tokens < max(batches) * max_tokens_needed:
        print("KV budget too small for the largest batch; raise --kv-budget-gb", file=sys.stderr)
        return 2
    bandwidth = hbm_bandwidth(device, args.hbm_gbps)
    weights = weight_bytes_per_step(llm)
    decode = []
    overlaps = ARMS[args.overlap]
    arms = [
        (f, ra, so)
        for f in ARMS[args.norm_fold]
        for ra in ARMS[args.rope_attention]
        for so in ARMS[args.skinny_o]
    ]
    for fold, rope, skinny_o in arms:
        # A captured graph keeps the GEMMs it recorded: each arm recaptures (lazily, at its first step).
        engine.runner.drop_graphs()
        engine.runner.set_norm_fold(fold)
        engine.runner.fused.rope_attention = rope_attention_enabled(rope)
        engine.runner.fused.skinny_o = skinny_o_enabled(skinny_o)
        for b in batches:
            for over in overlaps:
                r = engine_decode(engine, b, args.context_len, args.decode_steps, args.warmup_steps, over)
                mean_ctx = args.context_len + args.warmup_steps + args.decode_steps / 2
                step_bytes = weights + b * mean_ctx * engine.layout.bytes_per_token
                r["bytes_per_step"] = step_bytes
                r["roofline_ms"] = 1e3 * step_bytes / bandwidth if bandwidth else None
                decode.append(r)
    if args.profile and device.type == "cuda":
        ctx = args.context_len + args.warmup_steps + args.decode_steps + 1
        for b in sorted({batches[0], batches[-1]}):
            print(f"torch profiler, 3 decode-step bodies at batch {b} (eager, the graph's kernels):")
            print(profile_step(engine, b, ctx))
    prefill = engine_prefill(engine, args.prompt_len, args.prefill_iters)
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine_prefill(engine, args.prompt_len, 1)
        print(f"torch profiler, 2 prefills of {args.prompt_len} tokens:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    ref = None if args.no_floor else floor.reference(engine.runner, batches, device)
    if ref:
        flops = floor.prefill_flops(engine.runner, args.prompt_len)
        prefill["tflop"] = flops / 1e12
        prefill["tflop_s"] = flops / (prefill["ms"] / 1e3) / 1e12
        prefill["matmul_share"] = prefill["tflop_s"] / ref["matmul_tflop_s"]
        stack = {r["batch"]: r["ms"] for r in ref["matmul_stack"]}
        swapped = {r["batch"]: r["ms_swapped_head"] for r in ref["matmul_stack"]}
        for r in decode:
            r["floor_ms"] = stack[r["batch"]]
            r["floor_ratio"] = r["ms_per_step"] / stack[r["batch"]]
            r["floor_swapped_head_ms"] = swapped[r["batch"]]
            r["floor_swapped_head_ratio"] = r["ms_per_step"] / swapped[r["batch"]]
            if r.get("graph_replay_ms") is not None:
                r["replay_floor_ratio"] = r["graph_replay_ms"] / stack[r["batch"]]
    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "cuda_graphs": engine.runner.use_cuda_graphs,
        "compiled_layers": args.compile,
        "context_len": args.context_len,
        "decode_steps": args.decode_steps,
        "weight_bytes_per_step": weights,
        "hbm_bytes_per_s": bandwidth,
        "load_s": load_s,
        "engine_decode": decode,
        "engine_prefill": prefill,
        "kernels": engine.runner.kernel_backend,
        "kv_cache": args.kv_cache,
        "tables": [{"kernel": k, "path": path, "entries": n} for k, path, n in tables],
        "floor": ref,
    }
    if args.weights == "fp8":
        result["fp8"] = fp8_arm(engine, args, batches, decode, bandwidth)
    engine.shutdown()
    del engine  # free the KV pool and graphs before the baseline allocates its own cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf and args.weights == "bf16":
        result["transformers_decode"] = [
            hf_decode(llm, b, args.context_len, args.hf_decode_steps, device) for b in batches
        ]
        result["transformers_prefill"] = hf_prefill(llm, args.prompt_len, args.prefill_iters, device)
    text = json.dumps(result, indent=2)
    print(text)
    print()
    print(markdown(result))
    if result.get("fp8"):
        print()
        print(fp8_markdown(result["fp8"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
