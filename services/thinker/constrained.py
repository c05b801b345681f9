"""Constrained decoding: grammars for JSON output and tool calls, token masks filled on the host.

The grammar engine is llguidance (``LLMatcher``): it compiles a JSON Schema or a Lark grammar against
the thinker's tokenizer once per request and answers, for each step, which vocabulary entries may come
next as a bitmask (one bit per token, ``int32 [rows, ceil(V / 32)]``).

Timing (why the mask costs little): the engine launches a step's forward, then builds the masks of
the constrained rows on the host (:func:`fill_masks`, which hands all rows to llguidance's thread pool
in one call) while the device computes the logits; the sampler then applies the mask with one masked
fill per row group. The mask for step n+1 depends only on the tokens chosen up to step n, so nothing
waits for the device until the logits are read. In the overlapped decode
(:mod:`services.thinker.overlap`) nothing waits at all: the mask is uploaded and applied by operations
queued behind the step's replay, and the masked argmax feeds the next replay on the device.

Grammars emit compact JSON (``","`` and ``":"`` separators, no free whitespace), as OpenAI's own
outputs do, so a weak model cannot spend ``max_tokens`` on spaces, and objects carry only the keys their
schema declares (:func:`closed_objects`), so it cannot spend them on invented keys either. The tool-call grammar is the
model's own format (docs/model.md, "Tool calls"): ``<tool_call>`` and ``</tool_call>`` are single
tokens of the vocabulary, written as token ids in the grammar so the model must use those tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import thinker_pb2

# <|im_end|> ends the turn once the grammar is complete (docs/model.md, "Thinker generation").
IM_END_ID = 151645
TOOL_CALL_ID = 151657
TOOL_CALL_END_ID = 151658
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

Kind = thinker_pb2.Constraint.Kind


# Keywords whose values are subschemas: maps of them, single ones, lists of them (``allOf`` on its own).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONES = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
# Beside ``properties``, these keywords may admit keys that ``properties`` does not list.
_OPENS_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "dependencies",
    "dependentSchemas",
    "if",
)


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with each object that lists its ``properties`` and says nothing of other keys closed
    to those properties (``additionalProperties: false``).

    JSON Schema lets such an object carry any further key, and a grammar that allows them lets a weak
    model spend its whole budget inventing keys (frameworks send such schemas: instructor's and
    LangChain's tool parameters, non-strict ``json_schema`` formats). An object with only the declared
    keys is still valid, so the closed grammar generates a subset of the valid instances. Left open: an
    object that another keyword may widen (``allOf`` members and their holder, ``anyOf``/``oneOf``/``$ref``
    beside ``properties``, ``patternProperties``, ...), one whose ``required`` names an undeclared key,
    and one whose ``minProperties`` exceeds the declared keys.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, in_all_of=True) for sub in out["allOf"]]
    props = out.get("properties")
    required = out.get("required", [])
    min_props = out.get("minProperties", 0)
    if (
        not in_all_of
        and isinstance(props, dict)
        and not any(key in out for key in _OPENS_KEYS)
        and isinstance(required, list)
        and set(map(str, required)) <= set(props)
        and isinstance(min_props, int)
        and min_props <= len(props)
    ):
        out["additionalProperties"] = False
    return out


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    out = closed_objects(schema) if isinstance(schema, dict) else schema
    out["x-guidance"] = {**COMPACT, **(schema.get("x-guidance") or {})}
    return out


def _lark_string(text: str) -> str:
    """A Lark string literal for ``text`` (JSON escaping is a subset Lark accepts)."""
    return json.dumps(text, ensure_ascii=False)


def tool_call_lark(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """Lark grammar of one (or, with ``parallel``, several) ``<tool_call>`` blocks over ``tools``.

    Each block is ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` (the chat
    template's format) with ``ARGS`` compact JSON following the tool's parameter schema.
    """
    if not tools:
        raise StageError(
            INVALID_ARGUMENT, "a tool-call constraint needs at least one tool", "sampling.constraint"
        )
    rules = []
    alts = []
    for i, tool in enumerate(tools):
        name = str(tool["name"])
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        head = '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        rules.append(f"args{i}: %json{json.dumps(_compact(params), ensure_ascii=False)}")
        alts.append(f'<[{TOOL_CALL_ID}]> {_lark_string(head)} args{i} "}}\\n" <[{TOOL_CALL_END_ID}]>')
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, "call: " + "\n    | ".join(alts), *rules]) + "\n"


class GrammarCompiler:
    """The tokenizer-bound factory of matchers (one per thinker; building the token table takes ~1 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size = int(vocab_size)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=IM_END_ID
        )

    def grammar(self, msg: thinker_pb2.Constraint) -> str:
        """The llguidance grammar text for a proto constraint (raises INVALID_ARGUMENT on a bad spec)."""
        llm = self._llg.LLMatcher
        try:
            if msg.kind == Kind.KIND_JSON_OBJECT:
                return llm.grammar_from_json_schema(_compact({"type": "object"}))
            if msg.kind == Kind.KIND_JSON_SCHEMA:
                return llm.grammar_from_json_schema(_compact(json.loads(msg.spec)))
            if msg.kind == Kind.KIND_TOOL_CALLS:
                return llm.grammar_from_lark(tool_call_lark(json.loads(msg.spec), bool(msg.parallel)))
        except (ValueError, TypeError, KeyError) as exc:
            raise StageError(INVALID_ARGUMENT, f"bad constraint: {exc}", "sampling.constraint") from exc
        raise StageError(INVALID_ARGUMENT, f"unknown constraint kind {msg.kind}", "sampling.constraint")

    def matcher(self, msg: thinker_pb2.Constraint) -> TokenConstraint:
        return self.from_grammar(self.grammar(msg))

    def from_grammar(self, grammar: str, *, check: bool = True) -> TokenConstraint:
        """A matcher for llguidance grammar text (what :meth:`grammar` returns, or a bench's own).

        ``check=False`` skips the validation (~30 ms) for a grammar that was validated before: a duplex
        session builds a fresh matcher (~2 ms) for every call from the grammar it checked once.
        """
        if check:
            err = self._llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)  # "" when it compiles
            if err:
                raise StageError(INVALID_ARGUMENT, f"grammar does not compile: {err}", "sampling.constraint")
        return TokenConstraint(self._llg.LLMatcher(self.ll_tokenizer, grammar), self.vocab_size)


@dataclass
class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced by every chosen token."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int

    def accept(self, token: int) -> None:
        """Advance by the chosen token (a token the mask allowed; an error state ends in EOS only)."""
        self.matcher.consume_token(int(token))

    @property
    def failed(self) -> bool:
        return bool(self.matcher.is_error())

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_accepting()) and bool(self.matcher.is_stopped())


_MASKS = threading.local()


def mask_buffer(rows: int, vocab_size: int) -> torch.Tensor:
    """A reusable host bitmask ``int32 [rows, ceil(V/32)]`` (pinned when CUDA is up) for the engine thread.

    Waits first for the last asynchronous upload of the buffer (:func:`apply_masks`) to have left it: an
    overlapped decode step fills the next masks before anything else has synced with the device.
    """
    uploaded: torch.cuda.Event | None = getattr(_MASKS, "uploaded", None)
    if uploaded is not None:
        uploaded.synchronize()
        _MASKS.uploaded = None
    words = (vocab_size + 31) // 32
    buf: torch.Tensor | None = getattr(_MASKS, "buf", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
        pin = torch.cuda.is_available()
        buf = torch.empty((max(rows, 16), words), dtype=torch.int32, pin_memory=pin)
        _MASKS.buf = buf
    return buf[:rows]


def fill_masks(constraints: Sequence[TokenConstraint]) -> torch.Tensor:
    """Next-token bitmasks of ``constraints`` (host, one row each), filled in parallel by llguidance."""
    import llguidance.torch

    vocab = constraints[0].vocab_size
    mask = mask_buffer(len(constraints), vocab)
    if len(constraints) == 1:
        llguidance.torch.fill_next_token_bitmask(constraints[0].matcher, mask, 0)
    else:
        executor = getattr(_MASKS, "executor", None)
        if executor is None:
            executor = _MASKS.executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(
            executor, [(c.matcher, i) for i, c in enumerate(constraints)], mask
        )
    return mask


def apply_masks(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits [n, V]`` with every disallowed token at ``-inf`` (bits beyond the mask's V: allowed=0)."""
    n, vocab = logits.shape
    dev_mask = mask.to(logits.device, non_blocking=True)
    if logits.device.type == "cuda" and mask.device.type == "cpu":
        _MASKS.uploaded = torch.cuda.Event()
        _MASKS.uploaded.record()
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((dev_mask.unsqueeze(-1) >> bits) & 1).bool().reshape(n, -1)
    width = min(vocab, allowed.shape[1])
    out = logits.clone()
    out[:, :width] = out[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
    if vocab > width:
        out[:, width:] = float("-inf")
    return out
