"""CUDA smoke check: CUDA-graphed decode gives the same tokens as eager decode, for the thinker and the talker.

(``--stages code2wav`` adds the code2wav flow paths against its eager fp32 path: bench/cuda_smoke_code2wav.py.)

    python -m bench.cuda_smoke --checkpoint DIR [--device cuda] [--tokens 48] [--out-dir DIR]

Each engine is built twice on the same weights, once with ``use_cuda_graphs=True`` (decode steps replay a
graph captured per batch/context bucket) and once with ``False`` (eager), and runs the same greedy
requests: batch 1, then 3 concurrent requests (padded to the 4-row graph bucket, so the padding path is
exercised too) with different prompt lengths, then 3 where the third (20 tokens) arrives while the other
two decode, so its prefill and their decode rows replay one row graph (a mixed step, 32-row bucket: rotary
and attention in one launch), then 4 where the fourth (48 tokens, longer than that kernel's look-back)
arrives while three decode (a mixed step of 51 rows in the 64-row bucket, which attends in two launches).

* thinker: :class:`services.thinker.engine.ThinkerEngine`, greedy, ``ignore_eos``; compared: sampled
  tokens and the final-norm hidden row of every fed token. The eager engine runs the pure-torch kernels
  (``--eager-kernels torch``), the graphed one the default backend (Triton on CUDA: fused norms, rotary,
  cache writes and paged attention, and the cuBLAS GEMMs; graph steps run with the norm weights folded into
  the GEMMs, and the O projection with its residual add as one skinny Triton GEMM), so the comparison
  covers both the graphs and the kernels. The graphed engine runs on its own
  copy of the weights (folding changes them in place), the eager one and the reference logits on the
  unfolded ones;
* talker: :class:`services.talker.engine.TalkerEngine`, greedy codes (repetition penalty off, so the
  argmax of the observed logits is the chosen code), fixed frame count; compared: codes and the fp32
  logits of every step. As for the thinker, the eager engine runs the torch decode path and the graphed
  one the default backend (the fused Triton decode kernels on CUDA); the eager engine takes one step
  at a time, the graphed one ``--talker-steps-per-replay`` steps per replay (default: the engine's).
* ``--kv-cache fp8``: both thinker engines keep an e4m3 KV cache, so the Triton kernels' fp8 stores and
  loads are checked against torch's conversion (the CPU tests cannot: Triton's interpreter rounds some
  values to e4m3 wrongly).

Verdict per request: ``identical`` (same tokens), ``near-tie`` (at the first differing token the graph
picked the eager runner-up and the eager top-2 logit margin is below ``--tie-margin``; random weights make
such ties common) or ``MISMATCH``. Any MISMATCH exits 1. The drift of hidden rows / logits before the first
difference is reported (and enforced with ``--rel-tol``). Without CUDA it prints ``skipped: no CUDA`` and exits
0 (``--allow-cpu`` runs both variants on CPU, where graphs are inactive, to test the harness itself).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Comparison:
    stage: str
    batch: int
    request: int
    tokens: int
    verdict: str  # identical | near-tie | MISMATCH
    first_diff: int | None = None
    margin_at_diff: float | None = None  # eager top-2 logit margin at the first difference
    max_abs_diff_before: float = 0.0  # hidden rows (thinker) or logits (talker) on the shared prefix
    max_rel_diff_before: float = 0.0
    compared_rows: int = 0
    detail: str = ""
    gap_at_diff: float | None = None  # eager logit of the eager pick minus that of the graph's pick


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)  # per step: hidden row (thinker) / logits (talker)


Top2 = tuple[int, int, float]  # (best id, runner-up id, margin) of the eager logits that chose a token


def compare(
    stage: str,
    batch: int,
    request: int,
    eager: Run,
    graph: Run,
    top2: list[Top2 | None],
    tie_margin: float,
    rel_tol: float | None = None,
    logits_at: Callable[[int], torch.Tensor] | None = None,
) -> Comparison:
    """Tokens decide; ``top2[k]`` describes the eager logits that chose token k (None when unknown).

    A first difference is a ``near-tie`` only when the graph picked the eager runner-up and the eager
    margin is below ``tie_margin``: a broken graph produces tokens that are not the runner-up. With
    ``logits_at(k)`` (the eager logits that chose token k) the rule is the graph's pick scoring within
    ``tie_margin`` of the eager best under those logits (``gap_at_diff``), which also covers three-way
    ties, where the graph's pick need not be the runner-up. The hidden/logit drift on the shared prefix
    is reported, and enforced only when ``rel_tol`` is given.
    """
    n = min(len(eager.tokens), len(graph.tokens))
    first = next((k for k in range(n) if eager.tokens[k] != graph.tokens[k]), None)
    if first is None and len(eager.tokens) != len(graph.tokens):
        first = n
    upto = first if first is not None else n
    max_abs = max_rel = 0.0
    pairs = list(zip(eager.rows[:upto], graph.rows[:upto], strict=False))
    for a, b in pairs:
        d = (a.float() - b.float()).abs().max().item()
        scale = max(a.float().abs().max().item(), 1e-6)
        max_abs, max_rel = max(max_abs, d), max(max_rel, d / scale)
    c = Comparison(
        stage, batch, request, len(eager.tokens), "identical", first, None, max_abs, max_rel, len(pairs)
    )
    if first is not None:
        info = top2[first] if first < len(top2) else None
        near_tie = False
        if logits_at is not None and first < len(graph.tokens):
            lg = logits_at(first).float()
            best, _runner_up, margin = _top2(lg)
            c.margin_at_diff = margin
            c.gap_at_diff = float(lg[best] - lg[graph.tokens[first]])
            near_tie = c.gap_at_diff < tie_margin
        elif info is not None and first < len(graph.tokens):
            _best, runner_up, margin = info
            c.margin_at_diff = margin
            near_tie = graph.tokens[first] == runner_up and margin < tie_margin
        c.verdict = "near-tie" if near_tie else "MISMATCH"
        c.detail = f"eager {eager.tokens[first : first + 3]} vs graph {graph.tokens[first : first + 3]} at step {first}"
    if rel_tol is not None and max_rel > rel_tol:
        c.verdict = "MISMATCH"
        c.detail = (
            c.detail + "; " if c.detail else ""
        ) + f"max relative difference {max_rel:.3g} > {rel_tol}"
    return c


def _top2(logits: torch.Tensor) -> Top2:
    top = torch.topk(logits.float(), 2)
    return int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])


# ---- thinker -------------------------------------------------------------------------------------
def thinker_runs(
    llm: torch.nn.Module,
    device: torch.device,
    graphs: bool,
    prompts: list[list[int]],
    tokens: int,
    kv_bytes: int,
    late_after: int | None = None,
    kernels: str | None = None,
    kv_cache: str = "bf16",
) -> list[Run]:
    """Greedy runs of ``prompts``; with ``late_after`` the last prompt arrives after that many steps, so
    its prefill shares a step with the others' decode rows (a mixed step, replayed as a row graph when the
    step has at most 128 tokens)."""
    from services.thinker.engine import EngineConfig, ThinkerEngine
    from services.thinker.sampling import Sampler, SamplingConfig
    from services.thinker.scheduler import WorkItem

    engine = ThinkerEngine(
        llm,
        EngineConfig(max_num_seqs=8, kv_budget_bytes=kv_bytes, use_cuda_graphs=graphs, kv_cache=kv_cache),
        device,
    )
    engine.runner.set_kernels(kernels)
    if graphs and late_after is not None:
        # The mixed step's row bucket must exist: a step with prefill never captures (as in the server,
        # which captures every bucket at startup).
        engine.runner.warmup_graphs(len(prompts), 256)
    runs = [Run() for _ in prompts]
    for k, (run, prompt) in enumerate(zip(runs, prompts, strict=True)):
        if late_after is not None and k == len(prompts) - 1:
            for _ in range(late_after):
                engine.step()

        def sink(ev: Any, run: Run = run) -> None:
            if ev.error is not None:
                raise RuntimeError(f"thinker engine error: {ev.error}")
            if ev.hidden is not None:
                run.rows.append(ev.hidden.detach().to("cpu", torch.float32))
            if ev.token is not None:
                run.tokens.append(int(ev.token))

        cfg = SamplingConfig(max_tokens=tokens, ignore_eos=True, stop_token_ids=())
        seq = engine.open(sink)
        engine.submit(seq, WorkItem(prompt, sampler=Sampler(cfg), emit_hidden=True))
    engine.run_until_idle()
    active = engine.runner.use_cuda_graphs
    counts = dict(engine.runner.step_counts)
    counts["chained"] = engine.chained_steps  # overlapped decode steps (services.thinker.overlap)
    fold, folded_passes = engine.runner.norm_fold, engine.runner.fused.folded_passes
    print(
        f"[cuda_smoke] thinker {'graph' if graphs else 'eager'} engine steps ({engine.runner.kernel_backend} "
        f"kernels, folded norms {'on' if fold else 'off'}: {folded_passes} layer passes): {counts}",
        flush=True,
    )
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if graphs and device.type == "cuda" and not active:
        raise RuntimeError("thinker engine did not enable CUDA graphs")
    if graphs and active and late_after is not None and counts["graph_mixed"] < 1:
        raise RuntimeError(f"the late prompt's prefill did not replay a row graph: {counts}")
    if graphs and active and fold and folded_passes < 1:
        raise RuntimeError("the folded norms are on but no graph recorded them")
    return runs


def check_thinker(args: argparse.Namespace, device: torch.device) -> list[Comparison]:
    from services.common.checkpoint import Checkpoint
    from services.thinker.runner import build_qwen3_llm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ckpt = Checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    llm = build_qwen3_llm(
        ckpt.config,
        ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=dtype, device=device),
        dtype,
        str(device),
    )
    print(f"[cuda_smoke] thinker LLM loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    # The graphed engine may fold the norm weights into its GEMMs (in place, services.thinker.layer_ops):
    # it gets its own copy, so the eager engine and the transformers logits stay on the unfolded weights.
    graph_llm = copy.deepcopy(llm)
    gen = torch.Generator().manual_seed(1)
    vocab = int(ckpt.config.get("vocab_size", 151_000))
    out: list[Comparison] = []
    # The last cases: a 20-token prompt arrives after 5 steps, so 2 decode rows + its 20-token prefill
    # (22 tokens) run as one mixed row-graph step (the 32-row bucket: rotary + attention in one launch);
    # then a 48-token prompt beside 3 decode rows (51 tokens: the 64-row bucket, which attends in two
    # launches, so a chunk longer than the one launch's look-back is exact).
    cases = ((1, [64], None), (3, [64, 97, 33], None), (3, [64, 97, 20], 5), (4, [64, 97, 33, 48], 5))
    for batch, lengths, late in cases:
        prompts = [torch.randint(1000, min(vocab, 100_000), (n,), generator=gen).tolist() for n in lengths]
        eager = thinker_runs(
            llm, device, False, prompts, args.tokens, args.kv_bytes, late, args.eager_kernels, args.kv_cache
        )
        graph = thinker_runs(
            graph_llm,
            device,
            True,
            prompts,
            args.tokens,
            args.kv_bytes,
            late,
            args.graph_kernels,
            args.kv_cache,
        )
        for i, (e, g) in enumerate(zip(eager, graph, strict=True)):
            # Row k is the hidden of token k fed back; it chose token k+1. Token 0 came from the prefill.
            # Token 0 came from the prompt's last row, which the engine does not export: its logits are
            # the transformers forward of the prompt (same weights, dtype and device).
            def logits_at(
                k: int, e: Run = e, prompt: list[int] = prompts[i], model: torch.nn.Module = llm
            ) -> torch.Tensor:
                with torch.inference_mode():
                    if k == 0:
                        ids = torch.tensor([prompt], device=device)
                        return model(input_ids=ids).logits[0, -1]
                    return model.lm_head(e.rows[k - 1].to(device, dtype))

            c = compare("thinker", batch, i, e, g, [], args.tie_margin, args.rel_tol, logits_at)
            out.append(c)
            print(
                f"[cuda_smoke] thinker batch {batch} request {i}: {c.verdict} ({c.tokens} tokens, "
                f"max rel diff {c.max_rel_diff_before:.2e} over {c.compared_rows} rows) {c.detail}",
                flush=True,
            )
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- talker --------------------------------------------------------------------------------------
def talker_runs(
    model: Any,
    graphs: bool,
    conds: list[tuple[torch.Tensor, torch.Tensor]],
    frames: int,
    kernels: str | None = None,
    steps_per_replay: int | None = None,
) -> list[Run]:
    from services.talker.engine import TalkerEngine
    from services.talker.streams import ConditionInput, DoneOut, ErrorOut, WindowOut

    engine = TalkerEngine(
        model, max_streams=8, use_cuda_graphs=graphs, kernels=kernels, steps_per_replay=steps_per_replay
    )
    if graphs and model.device.type == "cuda" and not engine.runner.use_cuda_graphs:
        raise RuntimeError("talker engine did not enable CUDA graphs")
    runs = [Run() for _ in conds]
    by_stream: dict[int, Run] = {}

    def observe(st: Any, logits: torch.Tensor) -> None:
        by_stream[id(st)].rows.append(logits.detach().to("cpu", torch.float32))

    engine.logits_observer = observe
    for k, ((ids, hidden), run) in enumerate(zip(conds, runs, strict=True)):

        def emit(out: Any, run: Run = run, k: int = k) -> None:
            if isinstance(out, ErrorOut):
                raise RuntimeError(f"talker engine error: {out.error}")
            if isinstance(out, WindowOut):
                run.tokens.extend(out.window.codes[out.window.left_context :])
            if isinstance(out, DoneOut) and out.frames != frames:
                raise RuntimeError(f"talker stream {k} finished with {out.frames} frames, wanted {frames}")

        settings = engine.make_settings(
            sampling=engine.default_sampling(greedy=True, repetition_penalty=1.0), fixed_frames=frames
        )
        st = engine.open(settings, emit)
        by_stream[id(st)] = run
        engine.chunk(st, ConditionInput(ids, hidden, True, False, 0, 0, 0))
    engine.run_until_idle()
    del engine
    return runs


def check_talker(args: argparse.Namespace, device: torch.device) -> list[Comparison]:
    from services.common.checkpoint import Checkpoint
    from services.talker.model.tts import MiniCPMTTS

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = MiniCPMTTS.from_checkpoint(Checkpoint(args.checkpoint), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(2)
    out: list[Comparison] = []
    for batch, lengths in ((1, [40]), (3, [40, 17, 64])):
        conds = [
            (torch.randint(0, 151_000, (n,), generator=gen), torch.randn(n, model.cfg.llm_dim, generator=gen))
            for n in lengths
        ]
        eager = talker_runs(model, False, conds, args.frames, args.eager_kernels, 1)
        graph = talker_runs(model, True, conds, args.frames, args.graph_kernels, args.talker_steps_per_replay)
        for i, (e, g) in enumerate(zip(eager, graph, strict=True)):
            c = compare(
                "talker",
                batch,
                i,
                e,
                g,
                [_top2(r) for r in e.rows],
                args.tie_margin,
                args.rel_tol,
                logits_at=lambda k, e=e: e.rows[k],  # row k: the eager logits that chose code k
            )
            out.append(c)
            print(
                f"[cuda_smoke] talker batch {batch} request {i}: {c.verdict} ({c.tokens} frames, "
                f"max rel diff {c.max_rel_diff_before:.2e} over {c.compared_rows} logit rows) {c.detail}",
                flush=True,
            )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--stages", default="thinker,talker")
    p.add_argument("--tokens", type=int, default=48, help="thinker tokens per request")
    p.add_argument("--frames", type=int, default=60, help="talker frames per stream")
    p.add_argument("--kv-gb", type=float, default=2.0, help="thinker KV budget per engine")
    p.add_argument(
        "--kv-cache",
        choices=("bf16", "fp8"),
        default="bf16",
        help="thinker KV cache of both engines (fp8: the Triton kernels' e4m3 stores and loads against torch's)",
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=0.25,
        help="eager top-2 logit margin below which picking the runner-up counts as a tie",
    )
    p.add_argument(
        "--rel-tol",
        type=float,
        default=None,
        help="also fail when max |graph - eager| / max |eager| on the shared prefix exceeds this "
        "(default: report only; bf16 kernels of different shapes round differently)",
    )
    p.add_argument(
        "--eager-kernels",
        default="torch",
        help="kernel backend of the eager reference engines, thinker and talker (torch: the pure-torch path)",
    )
    p.add_argument(
        "--graph-kernels",
        default=None,
        help="kernel backend of the graphed engines, thinker and talker (default: auto, Triton on CUDA)",
    )
    p.add_argument(
        "--talker-steps-per-replay",
        type=int,
        default=None,
        help="decode steps per graph replay of the graphed talker engine (default: the engine's, 4 on "
        "CUDA); the eager reference always takes one step at a time",
    )
    p.add_argument(
        "--allow-cpu", action="store_true", help="run on CPU (graphs inactive) to test the harness"
    )
    p.add_argument("--out-dir", default=None, help="default: $OUT/cuda_smoke or ./bench-results/cuda_smoke")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.kv_bytes = int(args.kv_gb * 2**30)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        if not args.allow_cpu:
            print("[cuda_smoke] skipped: no CUDA", flush=True)
            return 0
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "cuda_smoke")
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    results: list[Comparison] = []
    if "thinker" in stages:
        results += check_thinker(args, device)
    if "talker" in stages:
        results += check_talker(args, device)
    code2wav: list[Any] = []
    if "code2wav" in stages:
        from bench.cuda_smoke_code2wav import check_code2wav

        code2wav = check_code2wav(args, device)
    failed = [c for c in results if c.verdict == "MISMATCH"] + [c for c in code2wav if c.verdict == "FAIL"]
    report = {
        "bench": "cuda_smoke",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda_graphs_active": device.type == "cuda",
        "tie_margin": args.tie_margin,
        "rel_tol": args.rel_tol,
        "status": "fail" if failed else "pass",
        "comparisons": [asdict(c) for c in results],
        "code2wav": [asdict(c) for c in code2wav],
    }
    (out_dir / "cuda_smoke.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| stage | batch | request | tokens | verdict | first diff | top-2 margin | gap to graph's pick "
        "| max rel diff before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results:
        margin = "—" if c.margin_at_diff is None else f"{c.margin_at_diff:.3g}"
        gap = "—" if c.gap_at_diff is None else f"{c.gap_at_diff:.3g}"
        lines.append(
            f"| {c.stage} | {c.batch} | {c.request} | {c.tokens} | {c.verdict} | "
            f"{'—' if c.first_diff is None else c.first_diff} | {margin} | {gap} "
            f"| {c.max_rel_diff_before:.2e} |"
        )
    if code2wav:
        from bench.cuda_smoke_code2wav import markdown

        lines += ["", *markdown(code2wav)]
    (out_dir / "cuda_smoke.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    print(
        f"[cuda_smoke] {report['status']}: {len(results) + len(code2wav) - len(failed)}/"
        f"{len(results) + len(code2wav)} requests / code2wav variants agree "
        f"(device {report['device_name']})",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
