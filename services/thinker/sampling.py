"""Per-request token choice: greedy, temperature, top-k, top-p, repetition penalty, seeds, stop rules.

Every request owns a :class:`Sampler` (its own ``torch.Generator`` when seeded, so a seeded request
reproduces whatever else shares the batch). The engine hands it one fp32 logits row per step. Rows of
plain greedy requests are chosen together with one batched ``argmax`` (:func:`choose_tokens`), which is
the common serving path and avoids a Python loop per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.common.errors import INVALID_ARGUMENT, StageError

# docs/model.md, Thinker generation: <|tts_eos|> ends the spoken span, <|im_end|> ends the turn.
DEFAULT_STOP_IDS: tuple[int, ...] = (151704, 151645)


@dataclass
class SamplingConfig:
    """Validated sampling parameters of one request (the engine never sees the proto)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    # Tokens of history the penalty looks at (None: the whole sequence, HF semantics).
    penalty_window: int | None = None
    seed: int | None = None
    max_tokens: int = 2048
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = DEFAULT_STOP_IDS

    def validate(self) -> SamplingConfig:
        for name in ("temperature", "top_p", "repetition_penalty"):
            # NaN passes every comparison below and then yields NaN probabilities that stall the sequence.
            if not math.isfinite(getattr(self, name)):
                raise StageError(INVALID_ARGUMENT, f"{name} must be a finite number", f"sampling.{name}")
        if self.temperature < 0:
            raise StageError(INVALID_ARGUMENT, "temperature must be >= 0", "sampling.temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise StageError(INVALID_ARGUMENT, "top_p must be in (0, 1]", "sampling.top_p")
        if self.top_k < 0:
            raise StageError(INVALID_ARGUMENT, "top_k must be >= 0", "sampling.top_k")
        if self.repetition_penalty <= 0:
            raise StageError(
                INVALID_ARGUMENT, "repetition_penalty must be > 0", "sampling.repetition_penalty"
            )
        if self.max_tokens < 1:
            raise StageError(INVALID_ARGUMENT, "max_tokens must be >= 1", "sampling.max_tokens")
        if self.min_tokens > self.max_tokens:
            raise StageError(INVALID_ARGUMENT, "min_tokens must be <= max_tokens", "sampling.min_tokens")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sampler:
    """Chooses the next token of one request and says when it is done.

    Subclasses (the duplex policy) override :meth:`choose` and :meth:`finish_reason`.
    """

    config: SamplingConfig
    generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_tokens

    @property
    def batchable_greedy(self) -> bool:
        """True when a plain argmax over the raw logits is exactly what :meth:`choose` would do."""
        c = self.config
        return (
            type(self) is Sampler
            and c.is_greedy
            and c.repetition_penalty == 1.0
            and (c.min_tokens == 0 or c.ignore_eos)
        )

    def _generator_for(self, device: torch.device) -> torch.Generator | None:
        if self.config.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(int(self.config.seed))
        return self.generator

    def choose(self, logits: torch.Tensor, history: Sequence[int], num_generated: int) -> int:
        """Pick the next token from fp32 ``logits [V]`` given the sequence so far."""
        logits = self.process(logits, history, num_generated)
        return self.draw(logits)

    @classmethod
    def choose_rows(
        cls,
        samplers: Sequence[Sampler],
        logits: torch.Tensor,
        histories: Sequence[Sequence[int]],
        num_generated: Sequence[int],
    ) -> list[int]:
        """Tokens for the rows of ``logits [n, V]``, all of whose samplers are of this class.

        The base class walks the rows; a subclass whose rule can run batched on the device (the duplex
        policy) overrides this, so a step costs it one host sync instead of a few per row.
        """
        return [s.choose(logits[i], histories[i], num_generated[i]) for i, s in enumerate(samplers)]

    def process(self, logits: torch.Tensor, history: Sequence[int], num_generated: int) -> torch.Tensor:
        """Penalty and stop-token masking; returns adjusted fp32 logits (a copy when modified)."""
        c = self.config
        if c.repetition_penalty != 1.0 and history:
            hist = history[-c.penalty_window :] if c.penalty_window else history
            ids = torch.tensor(sorted(set(hist)), dtype=torch.long, device=logits.device)
            picked = logits.index_select(0, ids)
            picked = torch.where(picked > 0, picked / c.repetition_penalty, picked * c.repetition_penalty)
            logits = logits.clone()
            logits.index_copy_(0, ids, picked)
        if num_generated < c.min_tokens and not c.ignore_eos and c.stop_token_ids:
            logits = logits.clone()
            logits[list(c.stop_token_ids)] = float("-inf")
        return logits

    def draw(self, logits: torch.Tensor) -> int:
        """Greedy or sampled draw after temperature, top-k then top-p (HF warper order)."""
        c = self.config
        if c.is_greedy:
            return int(torch.argmax(logits).item())
        return sample_from_logits(logits, c.temperature, c.top_k, c.top_p, self._generator_for(logits.device))

    def finish_reason(self, token: int, num_generated: int) -> str | None:
        """``"stop"`` on a stop id, ``"length"`` at ``max_tokens``; ``num_generated`` includes ``token``."""
        c = self.config
        if not c.ignore_eos and token in c.stop_token_ids:
            return "stop"
        if num_generated >= c.max_tokens:
            return "length"
        return None


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """Sample one id from fp32 ``logits [V]``; masked entries are ``-inf``."""
    scores = logits / max(temperature, 1e-5)
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop the low tail whose cumulative mass is <= 1 - top_p; always keep the best token.
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[-1] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose_tokens(
    samplers: Sequence[Sampler],
    logits: torch.Tensor,
    histories: Sequence[Sequence[int]],
    num_generated: Sequence[int],
) -> list[int]:
    """One token per row of ``logits [B, V]``.

    Plain greedy rows share one batched ``argmax``; the other rows are grouped by sampler class and each
    group is chosen by its class's :meth:`Sampler.choose_rows`.
    """
    out: list[int] = [0] * len(samplers)
    greedy_rows = [i for i, s in enumerate(samplers) if s.batchable_greedy]
    if len(greedy_rows) == len(samplers):  # the common serving step: one argmax, one host sync
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=logits.device)
        best = torch.argmax(logits.index_select(0, idx), dim=-1).tolist()
        for i, tok in zip(greedy_rows, best, strict=True):
            out[i] = int(tok)
    groups: dict[type[Sampler], list[int]] = {}
    for i, s in enumerate(samplers):
        if not s.batchable_greedy:
            groups.setdefault(type(s), []).append(i)
    for cls, rows in groups.items():
        picked = logits[rows].float() if len(rows) < len(samplers) else logits.float()
        tokens = cls.choose_rows(
            [samplers[i] for i in rows],
            picked,
            [histories[i] for i in rows],
            [num_generated[i] for i in rows],
        )
        for i, tok in zip(rows, tokens, strict=True):
            out[i] = int(tok)
    return out
