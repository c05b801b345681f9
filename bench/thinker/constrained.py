"""Per-step cost of grammar-constrained decoding: ``python -m bench.thinker.constrained --checkpoint DIR``.

Runs the thinker engine on the checkpoint's ``llm.*`` weights (a full-size random checkpoint has the
real shapes) and times full engine decode steps at each ``--batch`` size, in one process, same engine,
same graphs, in arms:

* ``greedy``: plain greedy rows (the serving fast path: the graph's argmax, overlapped decode);
* ``sampled``: temperature-1 rows (each seeded) without a grammar: drawn on the device behind the replay
  (one row after the other, the host path's draw) and chained like greedy steps
  (:mod:`services.thinker.overlap`);
* ``constrained``: greedy rows, each under a JSON grammar (llguidance, :mod:`services.thinker.constrained`)
  that never completes (a stream of JSON objects closed by a lexeme of the empty language), so every
  step fills and applies a real mask: filled on the host one step behind while the device runs the next
  replay, applied with the masked argmax queued behind it;
* ``mixed``: half the rows constrained, half plain greedy (one batch);
* ``constrained_sync``: the constrained arm with the overlapped decode off (``EngineConfig.overlap_decode``
  False), i.e. each step replays, waits, masks on the host path and plans the next: the cost that the
  overlap removes.

The headline is ``overhead_vs_greedy`` = arm ms/step / greedy ms/step - 1 (target for ``constrained``:
<= 5% at batch 16). Also reported: ``chained`` (the fraction of timed steps launched before their
predecessor was read: ~1 for every arm but ``constrained_sync`` when the overlap applies), the rows still
running at the end (every arm keeps its whole batch), and the host time of the mask fill alone per step
(llguidance's parallel fill over the rows). Prints one JSON object and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from services.common.checkpoint import Checkpoint
from services.thinker.constrained import COMPACT, GrammarCompiler, TokenConstraint, fill_masks
from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import Sampler, SamplingConfig
from services.thinker.scheduler import WorkItem

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


ARMS = ("greedy", "sampled", "constrained", "mixed", "constrained_sync")


def endless_json_grammar() -> str:
    """Objects of :data:`SCHEMA`, one per line, that never end: the closing lexeme matches nothing.

    (A closing byte the model could write, as this grammar first had, is a token like any other: the
    random model picked it among the few allowed after an object, and that row left the batch.)
    """
    schema = {**SCHEMA, "x-guidance": COMPACT}
    return "start: item+ NEVER\nNEVER: /[^\\s\\S]/\nitem: %json" + json.dumps(schema) + ' "\\n"\n'


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100000, (n,), generator=g).tolist()


def run_arm(
    engine: ThinkerEngine,
    compiler: GrammarCompiler,
    arm: str,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """ms per engine decode step of ``batch`` rows of one arm (after warm-up)."""
    seqs = []
    constraints: list[TokenConstraint] = []
    engine.overlap = not arm.endswith("_sync")
    for i in range(batch):
        ruled = arm.startswith("constrained") or (arm == "mixed" and i % 2 == 0)
        cfg = SamplingConfig(
            temperature=1.0 if arm == "sampled" else 0.0,
            seed=i if arm == "sampled" else None,
            max_tokens=warmup + steps + 1024,
            ignore_eos=not ruled,
        )
        sampler = Sampler(cfg)
        if ruled:
            sampler.constraint = compiler.from_grammar(endless_json_grammar())
            constraints.append(sampler.constraint)
        seq = engine.open(lambda _ev: None)
        engine.submit(seq, WorkItem(_prompt(context, 100 + i), sampler=sampler))
        seqs.append(seq)
    while any(s.next_token is None for s in seqs) or engine.scheduler.waiting:
        engine.step()
    for _ in range(warmup):
        engine.step()
    _sync(engine.device)
    chained0 = engine.chained_steps
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    dt = time.perf_counter() - t0
    chained = (engine.chained_steps - chained0) / steps
    running = sum(1 for s in seqs if s.work is not None)
    fill_ms = None
    if constraints:
        t1 = time.perf_counter()
        for _ in range(20):
            fill_masks(constraints)
        fill_ms = 1e3 * (time.perf_counter() - t1) / 20
    for s in seqs:
        engine.close(s)
    engine.run_until_idle()
    engine.overlap = True
    return {
        "arm": arm,
        "batch": batch,
        "ms_per_step": 1e3 * dt / steps,
        "chained": chained,
        "rows_running_at_end": running,
        "mask_fill_ms": fill_ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ckpt = Checkpoint(args.checkpoint)
    llm = build_qwen3_llm(
        ckpt.config,
        ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=dtype, device=device),
        dtype,
        str(device),
    )
    batches = [int(b) for b in args.batch.split(",") if b]
    tokens = args.context_len + args.warmup + args.steps + 1100
    cfg: Any = llm.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
    engine = ThinkerEngine(
        llm,
        EngineConfig(
            max_num_seqs=max(batches),
            max_step_tokens=max(512, args.context_len),
            kv_budget_bytes=int(1.3 * max(batches) * tokens * per_token) + (64 << 20),
            use_cuda_graphs=not args.no_cuda_graphs,
        ),
        device,
    )
    tokenizer = ckpt.tokenizer()
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    token_table_s = time.perf_counter() - t0
    results = []
    for b in batches:
        for arm in arms:
            results.append(run_arm(engine, compiler, arm, b, args.context_len, args.steps, args.warmup))
    by = {(r["arm"], r["batch"]): r for r in results}
    for r in results:
        base = by.get(("greedy", r["batch"]))
        r["overhead_vs_greedy"] = r["ms_per_step"] / base["ms_per_step"] - 1 if base else None
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "engine": "llguidance",
        "token_table_s": token_table_s,
        "context_len": args.context_len,
        "steps": args.steps,
        "results": results,
    }
    print(json.dumps(out, indent=1))
    print("\n| batch | arm | ms/step | vs greedy | chained | rows at end | mask fill ms (host) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        over = f"{100 * r['overhead_vs_greedy']:+.1f}%" if r["overhead_vs_greedy"] is not None else ""
        fill = f"{r['mask_fill_ms']:.3f}" if r["mask_fill_ms"] is not None else ""
        print(
            f"| {r['batch']} | {r['arm']} | {r['ms_per_step']:.3f} | {over} | {r['chained']:.2f} "
            f"| {r['rows_running_at_end']} | {fill} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
