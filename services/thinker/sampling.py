"""Per-request token choice: greedy, temperature, top-k, top-p, penalties, seeds, grammars, stop rules.

Every request owns a :class:`Sampler` (its own ``torch.Generator`` when seeded, so a seeded request
reproduces whatever else shares the batch). The engine hands it one fp32 logits row per step. Rows of
plain greedy requests are chosen together with one batched ``argmax`` (:func:`choose_tokens`), which is
the common serving path and avoids a Python loop per row.

Constrained rows (a grammar, :mod:`services.thinker.constrained`) get their token masks filled on the
host at the start of :func:`choose_tokens`, before anything reads the logits, so the mask work runs
while the device still computes the step. Stop strings are checked here too (:class:`StopCheck`), so
the engine ends the sequence on the token that completes a match.

Rows whose choice needs nothing from the host but the grammar mask (:attr:`Sampler.device_choice`:
greedy or temperature/top-k/top-p draws, with or without a grammar; no penalties, bias, ``min_tokens``
or logprobs) can also be chosen by :func:`choose_on_device`, which queues the same operations on the
device and writes the ids into a device buffer without a host sync; the overlapped decode
(:mod:`services.thinker.overlap`) feeds that buffer to the next step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.device import to_device
from services.common.errors import INVALID_ARGUMENT, StageError
from services.thinker.constrained import TokenConstraint, apply_masks, fill_masks

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
    # OpenAI penalties over the generated tokens: logit -= presence * [count > 0] + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits before everything else.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def validate(self) -> SamplingConfig:
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise StageError(INVALID_ARGUMENT, f"{name} must be in [-2, 2]", f"sampling.{name}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise StageError(INVALID_ARGUMENT, "stop takes 1 to 4 non-empty strings", "sampling.stop")
        if not 0 <= self.top_logprobs <= 20:
            raise StageError(INVALID_ARGUMENT, "top_logprobs must be in [0, 20]", "sampling.top_logprobs")
        if self.min_tokens > self.max_tokens:
            raise StageError(INVALID_ARGUMENT, "min_tokens must be <= max_tokens", "sampling.min_tokens")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise StageError(
                    INVALID_ARGUMENT,
                    "logit_bias maps token ids to biases in [-100, 100]",
                    f"logit_bias.{token}",
                )
        return self

    def check_vocab(self, vocab_size: int) -> SamplingConfig:
        """Refuse ``logit_bias`` ids that name no token of the tokenizer (``vocab_size`` entries)."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise StageError(
                    INVALID_ARGUMENT,
                    f"logit_bias names token id {token}, beyond the vocabulary (ids 0 to {vocab_size - 1})",
                    f"logit_bias.{token}",
                )
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when the logits change before the choice: penalties or a logit bias."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or bool(self.logit_bias)


class StopText:
    """Stop-string matching over a growing text: what may be shown now, and whether a stop matched.

    :meth:`feed` returns the text that can no longer be part of a match; a tail that could still grow
    into a stop string is held back (a match may span token boundaries). After a match nothing more is
    shown, and the shown text ends right before the match.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        if self.matched is not None:
            return ""
        self.pending += delta
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, stop = min(hits)
            self.matched = stop
            out, self.pending = self.pending[:at], ""
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back tail at the end of the stream (no stop matched)."""
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out


@dataclass
class StopCheck:
    """Engine-side stop strings: detokenizes the sequence's tokens and reports the first match."""

    detok: Any  # services.thinker.turn.IncrementalDetokenizer (push(id) -> text delta)
    text: StopText

    def push(self, token: int) -> bool:
        self.text.feed(self.detok.push(token))
        return self.text.matched is not None


@dataclass
class Sampler:
    """Chooses the next token of one request and says when it is done.

    Subclasses (the duplex policy) override :meth:`choose` and :meth:`finish_reason`.
    """

    config: SamplingConfig
    generator: torch.Generator | None = field(default=None, repr=False)
    constraint: TokenConstraint | None = field(default=None, repr=False)
    stop_check: StopCheck | None = field(default=None, repr=False)
    # Set by the last choice when config.logprobs: (chosen logprob, [(id, logprob)] best first), the
    # model's distribution before penalties and grammar masks.
    last_logprobs: tuple[float, list[tuple[int, float]]] | None = field(default=None, repr=False)

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_tokens

    @property
    def reserve_tokens(self) -> int:
        """New tokens whose KV the sequence reserves at admission (a duplex unit that may make a function
        call reserves the whole call, though its cap grows only once the call starts)."""
        return self.max_new_tokens

    @property
    def batchable_greedy(self) -> bool:
        """True when a plain argmax over the raw logits is exactly what :meth:`choose` would do."""
        c = self.config
        return (
            type(self) is Sampler
            and c.is_greedy
            and c.repetition_penalty == 1.0
            and (c.min_tokens == 0 or c.ignore_eos)
            and self.constraint is None
            and not c.logprobs
            and not c.has_penalties
        )

    @property
    def masked_greedy(self) -> bool:
        """True for a greedy row whose only adjustment is its grammar mask (a batched argmax after it)."""
        c = self.config
        return (
            type(self) is Sampler
            and self.constraint is not None
            and c.is_greedy
            and c.repetition_penalty == 1.0
            and not c.has_penalties
            and (c.min_tokens == 0 or c.ignore_eos)
        )

    @property
    def device_choice(self) -> bool:
        """True when the token is a function of the logits row, the grammar mask and the generator alone.

        Such a row can be chosen on the device (:func:`choose_on_device`) with no host read of its logits:
        greedy or a temperature/top-k/top-p draw, with or without a grammar. Penalties and ``logit_bias``
        (their own ops on the history), ``min_tokens`` masking and logprobs (a host copy of the
        distribution) keep a row on the host path.
        """
        c = self.config
        return (
            type(self) is Sampler
            and c.repetition_penalty == 1.0
            and not c.has_penalties
            and (c.min_tokens == 0 or c.ignore_eos)
            and not c.logprobs
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

    def accept(self, token: int) -> None:
        """The chosen token advances the grammar (called once per choice, in order)."""
        if self.constraint is not None:
            self.constraint.accept(token)

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
        """Logit bias, penalties and stop-token masking; returns adjusted fp32 logits (a copy when modified)."""
        c = self.config
        if c.logit_bias:
            ids = torch.tensor([t for t, _ in c.logit_bias], dtype=torch.long, device=logits.device)
            bias = torch.tensor([b for _, b in c.logit_bias], dtype=logits.dtype, device=logits.device)
            logits = logits.index_add(0, ids, bias)
        if (c.presence_penalty or c.frequency_penalty) and num_generated:
            gen = torch.tensor(
                list(history[len(history) - num_generated :]), dtype=torch.long, device=logits.device
            )
            counts = torch.bincount(gen, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
            logits = (
                logits - c.frequency_penalty * counts - c.presence_penalty * (counts > 0).to(logits.dtype)
            )
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
        if self.stop_check is not None and self.stop_check.push(token):
            return "stop"
        if num_generated >= c.max_tokens:
            return "length"
        return None


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """Sample one id from fp32 ``logits [V]``; masked entries are ``-inf``."""
    return int(sample_tensor(logits, temperature, top_k, top_p, generator).item())


def sample_tensor(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """:func:`sample_from_logits` without the read-back: the id as a one-element tensor on the logits'
    device (nothing here waits for the device: the draw's own checks are asynchronous)."""
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
    return torch.multinomial(probs, 1, generator=generator)


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
    raw = logits
    constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
    if constrained:
        # Host work first: the device may still be computing ``logits`` (nothing has synced yet).
        masks = fill_masks([samplers[i].constraint for i in constrained])  # type: ignore[misc]
        logits = logits.clone()
        idx = torch.tensor(constrained, device=logits.device)
        logits.index_copy_(0, idx, apply_masks(logits.index_select(0, idx).float(), masks).to(logits.dtype))
    # Rows whose choice is an argmax of (masked) logits share one batched argmax and one sync.
    argmax_rows = [i for i, s in enumerate(samplers) if s.batchable_greedy or s.masked_greedy]
    if argmax_rows:
        idx = torch.tensor(argmax_rows, device=logits.device)
        best = torch.argmax(logits.index_select(0, idx), dim=-1).tolist()
        for i, tok in zip(argmax_rows, best, strict=True):
            out[i] = int(tok)
    groups: dict[type[Sampler], list[int]] = {}
    for i, s in enumerate(samplers):
        if not (s.batchable_greedy or s.masked_greedy):
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
    _record_logprobs(samplers, raw, out)
    for i, s in enumerate(samplers):
        s.accept(out[i])
    return out


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 index tensor on ``device`` without a stream sync (a plain ``torch.tensor(...,
    device=cuda)`` waits for the queued work): staged through pinned memory, copied asynchronously."""
    return to_device(torch.tensor(list(values), dtype=torch.long), device)


def choose_on_device(
    samplers: Sequence[Sampler], logits: torch.Tensor, rows: Sequence[int], tokens: torch.Tensor
) -> None:
    """Queue the choice of ``logits [B, V]``'s rows ``rows`` into ``tokens [B]`` with no host sync.

    ``samplers[j]`` (each :attr:`Sampler.device_choice`) chooses row ``rows[j]``. ``tokens`` already holds
    every row's argmax of the raw logits (a row graph takes it), which is a plain greedy row's choice,
    so those rows are left as they are. Grammar rows get their masks filled on the host first (the
    device may still be computing ``logits``), then masked on the device like :func:`choose_tokens`
    does; greedy ones take the masked argmax, sampled ones draw from their own generator in row order.
    The operations and their inputs are those of :func:`choose_tokens` (fp32 rows, the same mask
    function, the same draw), so the tokens are the same. The grammars are not advanced here: the
    caller hands each chosen token to :meth:`Sampler.accept` once it has read it.
    """
    dev = logits.device
    constrained = [j for j, s in enumerate(samplers) if s.constraint is not None]
    where = {j: k for k, j in enumerate(constrained)}
    masked: torch.Tensor | None = None
    if constrained:
        masks = fill_masks([samplers[j].constraint for j in constrained])  # type: ignore[misc]
        idx = device_index([rows[j] for j in constrained], dev)
        masked = apply_masks(logits.index_select(0, idx).float(), masks)
        greedy = [k for k, j in enumerate(constrained) if samplers[j].config.is_greedy]
        if len(greedy) == len(constrained):
            tokens.index_copy_(0, idx, masked.argmax(dim=-1))
        elif greedy:
            sel = device_index(greedy, dev)
            tokens.index_copy_(0, idx.index_select(0, sel), masked.index_select(0, sel).argmax(dim=-1))
    for j, s in enumerate(samplers):
        c = s.config
        if c.is_greedy:
            continue
        row = masked[where[j]] if masked is not None and j in where else logits[rows[j]].float()
        drawn = sample_tensor(row, c.temperature, c.top_k, c.top_p, s._generator_for(dev))
        tokens[rows[j] : rows[j] + 1].copy_(drawn)


def _record_logprobs(samplers: Sequence[Sampler], raw: torch.Tensor, chosen: list[int]) -> None:
    """Log-probabilities of the rows that asked for them: one batched softmax/top-k, one host copy."""
    rows = [i for i, s in enumerate(samplers) if s.config.logprobs]
    if not rows:
        return
    idx = torch.tensor(rows, device=raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    k = max(samplers[i].config.top_logprobs for i in rows)
    picked = lp.gather(1, torch.tensor([[chosen[i]] for i in rows], device=raw.device)).squeeze(1)
    top_vals, top_ids = torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long())
    host = torch.cat([picked.unsqueeze(1), top_vals, top_ids.float()], dim=1).cpu()  # ids < 2^24: exact
    for j, i in enumerate(rows):
        n = samplers[i].config.top_logprobs
        vals = host[j, 1 : 1 + k].tolist()
        ids = host[j, 1 + k :].tolist()
        samplers[i].last_logprobs = (float(host[j, 0]), [(int(ids[t]), float(vals[t])) for t in range(n)])
