"""llguidance against xgrammar on the thinker's own vocabulary: ``python -m bench.thinker.grammar_engines``.

Why: constrained decoding (tools, ``response_format``) builds one next-token bitmask per constrained row
on the host every decode step, overlapped with the device's step. Which engine builds it faster decides
whether a constrained batch keeps pace with the GPU, so the choice is measured, not assumed.

Both engines get the same compact JSON Schema (no free whitespace, ``,`` / ``:`` separators), the same
tokenizer (the checkpoint's; the tiny checkpoint has the real 151k vocabulary) and the same token
stream: a schema-valid compact JSON document tokenized once. For each batch size every row walks that
stream; a step fills the masks of all rows (each engine's own batched, multi-threaded call) and then
advances every row by its next token. Reported per engine and batch: grammar compile time, and the
mask fill per step (p50 / p90 µs), which is the host work the engine overlaps with a ~5 ms decode step.
Host only: no GPU needed (run it on the GPU host too, whose 16 cores are what serving gets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from services.common.checkpoint import load_tokenizer

IM_END_ID = 151645  # <|im_end|>: the stop token the grammar ends on

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "stops": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "hours": {"type": "number"}},
                "required": ["name", "hours"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["city", "days", "units", "stops"],
    "additionalProperties": False,
}


def _document(stops: int) -> str:
    """A compact instance of SCHEMA with ``stops`` array items (the length of the token stream)."""
    doc = {
        "city": "Lisbon",
        "days": 5,
        "units": "metric",
        "stops": [{"name": f"Stop number {i} by the river", "hours": 1.5 + i} for i in range(stops)],
    }
    return json.dumps(doc, separators=(",", ":"))


class _Engine:
    """One grammar engine's compile / batched fill / advance, behind a common face."""

    name: str

    def compile(self) -> None: ...

    def start(self, rows: int) -> None: ...

    def fill(self) -> None: ...

    def advance(self, token: int) -> None: ...


class _Llguidance(_Engine):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=IM_END_ID)
        self.vocab = vocab
        self.executor = llguidance.LLExecutor()
        self.grammar = ""
        self.matchers: list[Any] = []
        self.mask = torch.empty(0)

    def compile(self) -> None:
        schema = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})
        self.grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        self.llg.LLMatcher(self.tok, self.grammar)  # the first matcher does the compile work

    def start(self, rows: int) -> None:
        self.matchers = [self.llg.LLMatcher(self.tok, self.grammar) for _ in range(rows)]
        self.mask = self.llg_torch.allocate_token_bitmask(rows, self.vocab)

    def fill(self) -> None:
        if len(self.matchers) == 1:
            self.llg_torch.fill_next_token_bitmask(self.matchers[0], self.mask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(self.matchers)]
            self.llg_torch.fill_next_token_bitmask_par(self.executor, pairs, self.mask)

    def advance(self, token: int) -> None:
        for m in self.matchers:
            m.consume_token(token)


class _Xgrammar(_Engine):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[IM_END_ID]
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab = vocab
        self.batch = xgrammar.BatchGrammarMatcher()
        self.compiled: Any = None
        self.matchers: list[Any] = []
        self.mask = torch.empty(0)

    def compile(self) -> None:
        self.compiled = self.compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )

    def start(self, rows: int) -> None:
        self.matchers = [self.xgr.GrammarMatcher(self.compiled) for _ in range(rows)]
        self.mask = self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self) -> None:
        if len(self.matchers) == 1:
            self.matchers[0].fill_next_token_bitmask(self.mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(self.matchers, self.mask)

    def advance(self, token: int) -> None:
        for m in self.matchers:
            if not m.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(engine: _Engine, tokens: list[int], batches: list[int]) -> dict[str, Any]:
    """Compile seconds and, per batch size, the per-step fill times (µs) over the whole token stream."""
    out: dict[str, Any] = {"engine": engine.name, "compile_ms": 1e3 * _time(engine.compile), "batches": {}}
    for rows in batches:
        engine.start(rows)
        fills = []
        for token in tokens:
            fills.append(1e6 * _time(engine.fill))
            engine.advance(token)
        fills.sort()
        out["batches"][rows] = {
            "steps": len(fills),
            "fill_us_p50": statistics.median(fills),
            "fill_us_p90": fills[int(0.9 * (len(fills) - 1))],
            "fill_us_mean": statistics.fmean(fills),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (its tokenizer is used)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--stops", type=int, default=8, help="array items in the JSON document (stream length)")
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    tokenizer = load_tokenizer(args.checkpoint)
    vocab = max(len(tokenizer), IM_END_ID + 1)
    tokens = list(tokenizer.encode(_document(args.stops), add_special_tokens=False))
    batches = [int(b) for b in args.batches.split(",")]
    makers = {"llguidance": _Llguidance, "xgrammar": _Xgrammar}
    results = []
    for name in args.engines.split(","):
        results.append(measure(makers[name](tokenizer, vocab), tokens, batches))
    print(f"token stream: {len(tokens)} tokens; vocabulary {vocab}; host threads {torch.get_num_threads()}")
    print("| engine | compile ms | batch | mask fill per step p50 / p90 / mean µs |")
    print("|---|---:|---:|---|")
    for r in results:
        for rows, b in r["batches"].items():
            print(
                f"| {r['engine']} | {r['compile_ms']:.1f} | {rows} | "
                f"{b['fill_us_p50']:.0f} / {b['fill_us_p90']:.0f} / {b['fill_us_mean']:.0f} |"
            )
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"tokens": len(tokens), "vocab": vocab, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
