"""What fp8 thinker weights cost against bf16: ``python -m bench.thinker.fp8_fidelity --checkpoint DIR``.

One engine, one process: for each prompt (a few fixed chat prompts through the checkpoint's tokenizer
and chat markers; ``--prompts N`` of them) the bf16 weights decode ``--tokens`` greedy tokens, keeping the
logits of every step. Then the same engine's weights are quantized to fp8
(:mod:`services.thinker.fp8_weights`), and per prompt

* **teacher-forced**: the fp8 model reads bf16's tokens; its logits at every step are compared with
  bf16's (max and mean absolute error, the error relative to the logits' spread) and its argmax with
  bf16's token (top-1 agreement);
* **free-running**: the fp8 model decodes greedily on its own; the tokens equal to bf16's before the first
  difference (greedy agreement) and the share of equal positions.

``--kv-cache fp8`` measures an e4m3 KV cache too: the candidate is then a second engine on the same
module with that cache (``--weights bf16`` leaves its weights alone, isolating the cache's cost).

Prints one JSON object and a Markdown table (the form docs/fidelity.md records). On the tiny random
checkpoint the logits are nearly flat, so greedy tokens part early there; the logit errors are the
comparable figure, and a full-size checkpoint is what the greedy agreement is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from services.common.checkpoint import Checkpoint
from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.runner import DecodeRow, ModelRunner, PrefillChunk, StepInput, build_qwen3_llm

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse in winter.",
    "List three prime numbers greater than 100 and say how you checked them.",
    "Translate 'good morning, how did you sleep?' into French and German.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of a heist movie in one paragraph.",
)


def prompt_ids(ckpt: Checkpoint, text: str) -> list[int]:
    """``text`` as one user turn of the chat format, ready for the assistant's reply."""
    tok = ckpt.tokenizer()
    chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(tok(chat, add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def decode(
    engine: ThinkerEngine, prompt: list[int], n: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """``n`` steps after ``prompt``: feeds ``forced`` tokens if given, else each step's argmax. Returns the
    argmax of every step and its logits ``[n, vocab]`` (fp32, on CPU)."""
    runner: ModelRunner = engine.runner
    bs = engine.layout.block_size
    blocks = engine.cache.pool.allocate(-(-(len(prompt) + n) // bs))
    try:
        out = runner.step(StepInput(prefill=[PrefillChunk(prompt, 0, blocks, want_logits=True)]))
        logits = [out.prefill_logits[0]]
        picks: list[int] = []
        for i in range(n):
            row = logits[-1]
            assert row is not None
            picks.append(int(row.argmax()))
            if i == n - 1:
                break
            tok = forced[i] if forced is not None else picks[-1]
            out = runner.step(StepInput(decode=[DecodeRow(tok, len(prompt) + i, blocks)]))
            logits.append(out.decode_logits[0])
        return picks, torch.stack([row.float().cpu() for row in logits if row is not None])
    finally:
        engine.cache.pool.release(blocks)


def compare(
    ref_tokens: list[int], ref: torch.Tensor, forced: torch.Tensor, free: list[int]
) -> dict[str, Any]:
    err = (forced - ref).abs()
    spread = ref.std(dim=-1).mean()
    forced_top1 = forced.argmax(dim=-1).tolist()
    same = [a == b for a, b in zip(free, ref_tokens, strict=True)]
    first_diff = same.index(False) if False in same else len(same)
    return {
        "logit_max_abs_err": float(err.max()),
        "logit_mean_abs_err": float(err.mean()),
        "logit_mean_abs_err_over_std": float(err.mean() / spread),
        "teacher_forced_top1_agreement": sum(a == b for a, b in zip(forced_top1, ref_tokens, strict=True))
        / len(ref_tokens),
        "greedy_tokens_before_first_difference": first_diff,
        "greedy_same_position_share": sum(same) / len(same),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{result['weights']} weights, {result['kv_cache']} KV cache vs bf16 weights and cache — "
        f"{result['device_name']}, {result['dtype']}, kernels "
        f"{result['kernels']}, {result['tokens']} greedy tokens per prompt:",
        "",
        "| prompt | tokens | logit max abs err | logit mean abs err | mean err / logit std "
        "| teacher-forced top-1 agreement | greedy tokens equal before first difference | greedy same-position share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(result["prompts"]):
        lines.append(
            f"| {i} | {r['prompt_tokens']} | {r['logit_max_abs_err']:.4f} | {r['logit_mean_abs_err']:.4f} "
            f"| {r['logit_mean_abs_err_over_std']:.4f} | {100 * r['teacher_forced_top1_agreement']:.1f}% "
            f"| {r['greedy_tokens_before_first_difference']} / {result['tokens']} "
            f"| {100 * r['greedy_same_position_share']:.1f}% |"
        )
    s = result["summary"]
    lines += [
        "",
        f"Over all prompts: logit max abs err {s['logit_max_abs_err']:.4f}, mean abs err "
        f"{s['logit_mean_abs_err']:.4f} ({s['logit_mean_abs_err_over_std']:.4f} of the logits' std), "
        f"teacher-forced top-1 agreement {100 * s['teacher_forced_top1_agreement']:.1f}%, greedy tokens equal "
        f"before the first difference {s['greedy_tokens_before_first_difference']:.1f} of {result['tokens']} "
        "(mean).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.thinker.fp8_fidelity", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    ap.add_argument("--kernels", default=None, help="thinker kernel backend: torch | triton | auto")
    ap.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(PROMPTS)} fixed prompts")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="fp8", help="the candidate's weights")
    ap.add_argument("--kv-cache", choices=["bf16", "fp8"], default="bf16", help="the candidate's KV cache")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ckpt = Checkpoint(args.checkpoint)
    llm = build_qwen3_llm(
        ckpt.config,
        ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=dtype, device=device),
        dtype,
        str(device),
    )
    prompts = [prompt_ids(ckpt, text) for text in PROMPTS[: args.prompts]]
    need = max(len(p) for p in prompts) + args.tokens + 64

    def build(kv_cache: str) -> ThinkerEngine:
        engine = ThinkerEngine(
            llm,
            EngineConfig(
                max_num_seqs=1,
                kv_budget_bytes=4 * need * _bytes_per_token(llm, dtype),
                use_cuda_graphs=False,
                kv_cache=kv_cache,
            ),
            device,
        )
        engine.runner.set_kernels(args.kernels)
        return engine

    engine = build("bf16")
    t0 = time.perf_counter()
    refs = [decode(engine, p, args.tokens) for p in prompts]
    bf16_s = time.perf_counter() - t0
    if args.kv_cache != "bf16":
        engine.shutdown()
        engine = build(args.kv_cache)  # same module: the folded norms compute the same function
    if args.weights == "fp8":
        engine.runner.quantize_weights()
    rows = []
    for p, (ref_tokens, ref_logits) in zip(prompts, refs, strict=True):
        _, forced = decode(engine, p, args.tokens, forced=ref_tokens)
        free, _ = decode(engine, p, args.tokens)
        rows.append({"prompt_tokens": len(p), **compare(ref_tokens, ref_logits, forced, free)})
    keys = [k for k in rows[0] if k != "prompt_tokens"]
    summary = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    summary["logit_max_abs_err"] = max(r["logit_max_abs_err"] for r in rows)
    result = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": engine.runner.kernel_backend,
        "checkpoint": args.checkpoint,
        "tokens": args.tokens,
        "weights": args.weights,
        "kv_cache": args.kv_cache,
        "bf16_decode_s": bf16_s,
        "prompts": rows,
        "summary": summary,
    }
    text = json.dumps(result, indent=2)
    print(text)
    print()
    print(markdown(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


def _bytes_per_token(llm: torch.nn.Module, dtype: torch.dtype) -> int:
    cfg: Any = llm.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 2 * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * head_dim * dtype.itemsize


if __name__ == "__main__":
    raise SystemExit(main())
