"""What one engine step hands the model runner, and what it gets back.

These are their own module so that the runner's helpers (the row graphs, the fused layer loop) can name
them without importing the runner that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeRow:
    """One token of a running sequence: its id, its position and the blocks that hold its context."""

    token_id: int
    position: int
    blocks: list[int]


@dataclass
class PrefillChunk:
    """Consecutive prompt tokens of one sequence starting at ``start``; ``embeds`` overrides the text
    embeddings of the chunk's first ``embeds.shape[0]`` rows (all of them, or fewer)."""

    token_ids: list[int]
    start: int
    blocks: list[int]
    embeds: torch.Tensor | None = None
    want_logits: bool = False
    # Return this chunk's final-norm hidden rows (teacher-forced speech exports the rows of prompt tokens).
    want_hidden: bool = False


@dataclass
class StepInput:
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(c.token_ids) for c in self.prefill)


@dataclass
class StepOutput:
    """Final-norm hidden states and fp32 logits of the rows that produce a next token."""

    decode_hidden: torch.Tensor  # [len(decode), hidden]
    decode_logits: torch.Tensor  # [len(decode), vocab] fp32
    prefill_logits: list[torch.Tensor | None]  # last-row logits per chunk, when asked
    # Graph steps: the argmax of every row with logits (decode rows, then the chunks that asked), taken
    # inside the graph (bf16 argmax = fp32 argmax, first index on ties). A device view, valid until the
    # next step; None for eager steps.
    greedy_tokens: torch.Tensor | None = None
    # Per prefill chunk: its hidden rows [n, hidden] (a copy) when the chunk asked (``want_hidden``).
    prefill_hidden: list[torch.Tensor | None] = field(default_factory=list)
