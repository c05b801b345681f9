"""Talker throughput: the project's engine vs a plain transformers-style loop, same weights, same run.

    python -m bench.talker --checkpoint DIR --device cuda [--batches 1,4,8,16] [--frames 500]

For each batch size B, B streams each generate exactly ``--frames`` codec frames (EOS masked, the
benchmark ``fixed_frames`` mode) from a ``--cond-len``-row whole-utterance condition, with the real
sampling (temperature 0.8, top-p 0.85, top-k 25, repetition penalty 1.05 over 16 frames). Reported:

* engine — :class:`services.talker.engine.TalkerEngine` (static slot KV cache, batched decode, CUDA
  graphs on GPU); per-stream frames/s = frames / wall time of the batch (all B streams concurrently);
* baseline — transformers ``LlamaModel`` with a ``DynamicCache``, batch B, one forward per frame,
  transformers' own warpers and ``torch.multinomial`` (what a straightforward port does), run for
  ``--baseline-frames`` frames because it is slow.

* ms/step — engine wall time per decode step (all B streams advance one frame per step);
  graph replay ms — GPU time of one captured decode+sample step alone (CUDA graphs only; with K steps
  per replay, ``--steps-per-replay``, the K-step block graph's time / K): the gap
  between the two is host time per step (Python bookkeeping, one small H2D + one D2H copy, the sync).

Targets (issue 4): ≥ 1000 frames/s at batch 1 (40× real time at 25 frames/s) and ≥ 500 frames/s per
stream with 16 streams. Prints one JSON object, then a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch

from bench.output import publish
from services.common.checkpoint import Checkpoint
from services.talker import multistep
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import MIN_LENGTH_BUCKET, next_bucket
from services.talker.streams import ConditionInput, DoneOut, Output

FRAME_RATE = 25.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _conditions(model: MiniCPMTTS, n: int, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 151000, (length,), generator=gen)
        out.append((ids, torch.randn(length, model.cfg.llm_dim, generator=gen)))
    return out


def run_engine(engine: TalkerEngine, conds: list[tuple[torch.Tensor, torch.Tensor]], frames: int) -> float:
    """All streams at once; returns wall seconds until every stream is done."""
    done: list[Output] = []
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    for k, (ids, hidden) in enumerate(conds):
        settings = engine.make_settings(sampling=engine.default_sampling(seed=k), fixed_frames=frames)
        st = engine.open(settings, done.append)
        engine.chunk(st, ConditionInput(ids, hidden, True, False, 0, 0, 0))
        engine.end(st)  # one turn per stream: the engine drops it after its Done
    engine.run_until_idle()
    _sync(engine.runner.device)
    wall = time.perf_counter() - t0
    finished = [o for o in done if isinstance(o, DoneOut)]
    if len(finished) != len(conds) or any(o.frames != frames for o in finished):
        raise RuntimeError(f"engine run incomplete: {[(o.finish_reason, o.frames) for o in finished]}")
    return wall


def graph_replay_ms(engine: TalkerEngine, bsz: int, length: int, replays: int = 50) -> float | None:
    """GPU time per decode step of a captured replay (CUDA graphs only), all rows idle (writes hit scratch).

    With K steps per replay this is the K-step block graph's time / K. Compared with the engine's
    ms/step this splits a step into device time and host time.
    """
    runner = engine.runner
    if not runner.use_cuda_graphs:
        return None
    n = min(next_bucket(bsz), runner.cache.num_slots)
    read_len = min(next_bucket(length, MIN_LENGTH_BUCKET), runner.context)
    steps = engine.steps_per_replay
    with torch.inference_mode():
        if runner.blocks is not None:
            graph = runner.blocks._graph(n, read_len, steps)
            if graph is not None:
                graph.ints[:, multistep.ACTIVE_COLUMNS] = 0  # every row idle: K/V to the scratch column
        else:
            steps = 1
            graph = runner._graph(n, read_len)
            if graph is not None:
                graph.ints[:, 2].zero_()  # inactive rows: their K/V go to the scratch column
        if graph is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.graph.replay()
        torch.cuda.synchronize(runner.device)
        start.record()
        for _ in range(replays):
            graph.graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / replays / steps


@torch.inference_mode()
def run_baseline(model: MiniCPMTTS, conds: list[tuple[torch.Tensor, torch.Tensor]], frames: int) -> float:
    """Plain loop: LlamaModel + DynamicCache, batch of equal-length conditions, HF warpers, multinomial."""
    from transformers import DynamicCache
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    cfg = model.cfg
    dev = model.device
    top_p, top_k = (
        TopPLogitsWarper(cfg.top_p, min_tokens_to_keep=3),
        TopKLogitsWarper(cfg.top_k, min_tokens_to_keep=3),
    )
    rows = torch.stack([model.whole_utterance_condition(ids, hidden) for ids, hidden in conds])
    bsz, length, _ = rows.shape
    gen = torch.Generator(device=dev).manual_seed(0)
    _sync(dev)
    t0 = time.perf_counter()
    cache = DynamicCache()
    positions = torch.arange(length, device=dev)[None].expand(bsz, -1)
    res = model.model(inputs_embeds=rows, position_ids=positions, past_key_values=cache, use_cache=True)
    history = torch.empty(bsz, 0, dtype=torch.long, device=dev)
    for t in range(frames):
        logits = model.head_logits(res.last_hidden_state[:, -1]) / cfg.temperature
        if t > 0:
            recent = history[:, -16:]
            freq = torch.nn.functional.one_hot(recent, logits.shape[1]).sum(1)
            alpha = torch.pow(torch.tensor(cfg.repetition_penalty, device=dev), freq)
            logits = torch.where(logits < 0, logits * alpha, logits / alpha)
            logits = top_k(None, top_p(None, logits))
        logits[:, cfg.eos_id] = float("-inf")
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        history = torch.cat([history, nxt], dim=1)
        pos = torch.full((bsz, 1), length + t, device=dev)
        res = model.model(
            inputs_embeds=model.emb_code[0](nxt), position_ids=pos, past_key_values=cache, use_cache=True
        )
    _sync(dev)
    return time.perf_counter() - t0


def run_batch(engine: TalkerEngine, model: MiniCPMTTS, args: argparse.Namespace, bsz: int) -> dict[str, Any]:
    """One batch size on one engine: warm-up, timed runs (best of ``--repeats``), graph replay, baseline."""
    conds = _conditions(model, bsz, args.cond_len, seed=bsz)
    t0 = time.perf_counter()
    engine.runner.warmup_graphs(bsz, args.cond_len + 2 + args.frames)  # no capture inside timed runs
    warmup_s = time.perf_counter() - t0  # start-up cost: captures (and, first time, Triton compiles)
    run_engine(engine, conds, min(args.frames, 64))  # warm-up: allocator, kernels
    walls = [run_engine(engine, conds, args.frames) for _ in range(max(1, args.repeats))]
    wall = min(walls)
    row: dict[str, Any] = {
        "batch": bsz,
        "frames_per_stream": args.frames,
        "engine_wall_s": round(wall, 4),
        "engine_fps_per_stream": round(args.frames / wall, 1),
        "engine_fps_total": round(bsz * args.frames / wall, 1),
        "engine_realtime_x": round(args.frames / wall / FRAME_RATE, 1),
        "engine_ms_per_step": round(wall * 1000 / args.frames, 3),
        "graph_warmup_s": round(warmup_s, 2),
    }
    replay = graph_replay_ms(engine, bsz, args.cond_len + 2 + args.frames // 2)
    if replay is not None:
        row["graph_replay_ms"] = round(replay, 3)  # device time of one step; the rest is host time
    if args.baseline_frames > 0:
        run_baseline(model, conds, min(4, args.baseline_frames))  # warm-up
        b_wall = run_baseline(model, conds, args.baseline_frames)
        row["baseline_fps_per_stream"] = round(args.baseline_frames / b_wall, 1)
        row["speedup"] = round(row["engine_fps_per_stream"] / row["baseline_fps_per_stream"], 1)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.talker", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="full-size random checkpoint for meaningful numbers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--frames", type=int, default=500, help="frames per stream (500 = 20 s of audio)")
    ap.add_argument("--baseline-frames", type=int, default=64, help="0 skips the baseline")
    ap.add_argument("--cond-len", type=int, default=64, help="condition rows per stream (Thinker span)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (best is reported)")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--kernels",
        default="auto",
        help="decode kernel backends to run, comma-separated (torch, triton, auto); each gets its own engine",
    )
    ap.add_argument(
        "--steps-per-replay",
        default="",
        help="decode steps per graph replay to compare, comma-separated (e.g. 1,4,8); each gets its own "
        "engine per backend. Default: the engine's default (4 with CUDA graphs, 1 without)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    ckpt = Checkpoint(args.checkpoint)
    model = MiniCPMTTS.from_checkpoint(ckpt, dtype=dtype, device=device)
    batches = [int(b) for b in args.batches.split(",") if b]
    rows: list[dict[str, Any]] = []
    graphs_on = False
    steps_list: list[int | None] = [int(k) for k in args.steps_per_replay.split(",") if k.strip()] or [None]
    for kernels in [k.strip() for k in args.kernels.split(",") if k.strip()]:
        for steps in steps_list:
            engine = TalkerEngine(
                model,
                max_streams=max(batches),
                use_cuda_graphs=False if args.no_cuda_graphs else None,
                kernels=kernels,
                steps_per_replay=steps,
            )
            graphs_on = engine.runner.use_cuda_graphs
            k = engine.steps_per_replay
            tag = {"kernels": engine.runner.kernels, "steps_per_replay": k}
            rows += [dict(run_batch(engine, model, args, bsz), **tag) for bsz in batches]
            del engine
    result = {
        "bench": "talker",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": dtype_name,
        "cuda_graphs": graphs_on,
        "model": {
            "layers": model.cfg.num_hidden_layers,
            "hidden": model.cfg.hidden_size,
            "heads": model.cfg.num_attention_heads,
            "codec_vocab": model.cfg.num_audio_tokens,
        },
        "cond_len": args.cond_len,
        "torch": torch.__version__,
        "rows": rows,
        "targets": {"batch1_fps": 1000, "batch16_fps_per_stream": 600},
    }
    publish(result, markdown_table(result), args.out)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    head = (
        f"Talker on {result['device']} ({result['dtype']}, CUDA graphs {'on' if result['cuda_graphs'] else 'off'}, "
        f"{result['model']['layers']}×{result['model']['hidden']}, condition {result['cond_len']} rows)\n\n"
        "| kernels | steps/replay | streams | engine frames/s per stream | engine frames/s total | × real time | "
        "ms/step | graph replay ms/step | baseline frames/s per stream | speedup |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in result["rows"]:
        lines.append(
            f"| {r.get('kernels', '—')} | {r.get('steps_per_replay', 1)} | {r['batch']} | {r['engine_fps_per_stream']} | {r['engine_fps_total']} | {r['engine_realtime_x']} | "
            f"{r['engine_ms_per_step']} | {r.get('graph_replay_ms', '—')} | "
            f"{r.get('baseline_fps_per_stream', '—')} | {r.get('speedup', '—')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
