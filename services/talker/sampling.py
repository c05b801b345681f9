"""Codec sampling with upstream MiniCPMTTS's rules, batched over rows with per-row parameters.

Upstream order for one step (``MiniCPMTTS.generate`` / ``generate_chunk`` / ``TTSStreamingGenerator``):

1. ``logits / temperature`` (fp32);
2. processors — the repetition penalty, *frequency based over the last 16 frames*: α = penalty^count,
   negative logits × α, positive logits ÷ α;
3. warpers — top-p (keep the smallest top set whose mass exceeds p, at least 3 tokens) then top-k
   (k raised to at least 3); ties with the k-th value are kept;
4. EOS masked (−inf) when the mode's rule says so (e.g. ``t < min_new_token``);
5. softmax and one draw.

Which of (2)/(3) apply is a per-row, per-step decision the engine makes through :class:`StepRules`:
no processors and no warpers on a stream's very first sample (upstream's ``audio_bos`` step), and duplex
units apply only the penalty (their warpers are built upstream but never called, docs/model.md, Talker
sampling).

How it runs: every per-row knob (temperature, penalty, top-p, top-k, rule flags, the draw key made
from seed and draw counter, the 16-frame history) is packed into one int64 and one fp32 tensor (:func:`pack_rows`), and
:func:`sample_packed` does steps 1–5 as fixed-shape tensor ops with no host decision in between, so
the runner captures it in the same CUDA graph as the decode forward and only the picked ids come back.

The draw is a Gumbel-max (exponential race): ``argmax(scores + g)`` with ``g = −log(−log u)`` picks token
``i`` with probability ``softmax(scores)_i``. Each ``u`` is a counter-based uniform: an integer hash of
(request seed, the row's draw index within its turn, vocab id), computed with 32-bit arithmetic in
torch ops. A row's draw is therefore a pure function of its own seed, draw index and scores: it does not
depend on which other streams share the batch, needs no CPU generator, no device→host round trip and no
graph-unfriendly RNG state. ``greedy`` rows take the argmax instead (tests, fidelity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PENALTY_WINDOW = 16
MIN_TOKENS_TO_KEEP = 3

# Duplex budgets (docs/model.md, Talker streaming and budgets): 26 samples per unit, the 26th dropped, so 25
# frames ≈ 1 s.
DUPLEX_SAMPLES_PER_UNIT = 26
DUPLEX_FRAMES_PER_UNIT = DUPLEX_SAMPLES_PER_UNIT - 1
# Turn end: up to 4 units of samples, no floor, EOS ignored for 5 steps after every 25-frame boundary
# (the model emits a cadence EOS there whether or not its text is spoken).
DUPLEX_TURN_END_SAMPLES = 4 * DUPLEX_SAMPLES_PER_UNIT
DUPLEX_TURN_END_BOUNDARY_MASK_STEPS = 5


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling knobs (defaults come from ``tts_config`` via the engine)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    greedy: bool = False


@dataclass(frozen=True)
class StepRules:
    """What applies to one row at one step."""

    apply_penalty: bool
    apply_warpers: bool
    mask_eos: bool


@dataclass
class RowState:
    """Per-request sampling state: its params, its draw counter and its penalty history (last frames only)."""

    params: SamplingParams
    history: list[int] = field(default_factory=list)
    draws: int = 0  # random draws made so far this turn: the counter of the next draw's uniforms

    def remember(self, code: int) -> None:
        self.history.append(int(code))
        if len(self.history) > PENALTY_WINDOW:
            del self.history[: len(self.history) - PENALTY_WINDOW]

    def clear_history(self) -> None:
        self.history.clear()


# -------------------------------------------------------------------------------------- step rules
def whole_utterance_rules(t: int, min_new_frames: int, never_stop: bool = False) -> StepRules:
    """Upstream ``MiniCPMTTS.generate``: step 0 raw (temperature only); EOS masked while t < min."""
    first = t == 0
    return StepRules(
        apply_penalty=not first, apply_warpers=not first, mask_eos=never_stop or t < min_new_frames
    )


def streaming_chunk_rules(stream_frames: int, t: int) -> StepRules:
    """Upstream ``TTSStreamingGenerator``: only the stream's very first sample is raw; EOS never masked."""
    first = stream_frames == 0 and t == 0
    return StepRules(apply_penalty=not first, apply_warpers=not first, mask_eos=False)


@dataclass(frozen=True)
class DuplexBudget:
    """Samples allowed in one duplex unit and the EOS floor (docs/model.md, Talker streaming and budgets)."""

    max_samples: int
    min_samples: int
    turn_end: bool

    @property
    def max_frames(self) -> int:
        # Upstream drops the final sample of a unit, so at most max_samples - 1 frames survive.
        return self.max_samples - 1


def duplex_budget(turn_start: bool, turn_end: bool) -> DuplexBudget:
    """26 samples with EOS masked throughout; turn start: no floor (allows <1 s); turn end: ≤104, no floor."""
    if turn_end:
        return DuplexBudget(DUPLEX_TURN_END_SAMPLES, 0, True)
    return DuplexBudget(DUPLEX_SAMPLES_PER_UNIT, 0 if turn_start else DUPLEX_SAMPLES_PER_UNIT, False)


def duplex_rules(t: int, budget: DuplexBudget) -> StepRules:
    """Upstream ``generate_chunk``: penalty from t>0 (this unit's frames), no warpers, EOS per budget."""
    mask = t < budget.min_samples
    if budget.turn_end and t >= DUPLEX_FRAMES_PER_UNIT:
        mask = mask or (t % DUPLEX_FRAMES_PER_UNIT) < DUPLEX_TURN_END_BOUNDARY_MASK_STEPS
    return StepRules(apply_penalty=t > 0, apply_warpers=False, mask_eos=mask)


# ------------------------------------------------------------------------------ counter-based uniforms
_U32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_VOCAB_SALT = 0x632BE5AB


def mix_u32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply, two rounds) in int64 torch ops.

    ``x`` holds values in [0, 2³²). Both multipliers are odd and below 2³¹, so every product stays
    below 2⁶³: exact int64 arithmetic on every device (no reliance on overflow wrapping), 10 kernels.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x045D9F3B) & _U32
    return x ^ (x >> 16)


def vocab_salt(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-vocab-id hash constants [V] (int64); the runner makes them once, before any graph capture."""
    return mix_u32(torch.arange(vocab, dtype=torch.int64, device=device) ^ _VOCAB_SALT)


def mix_u32_int(x: int) -> int:
    """:func:`mix_u32` on one Python int (the host computes per-row keys with it)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _U32
    x ^= x >> 15
    x = (x * 0x045D9F3B) & _U32
    return x ^ (x >> 16)


def row_key(seed: int, counter: int) -> int:
    """One 32-bit key per (request seed, draw index): the row part of every uniform of that draw.

    Made on the host (three integer hashes, about a microsecond) so the graph spends no kernels on it.
    """
    seed &= 0xFFFFFFFFFFFFFFFF
    key = mix_u32_int((seed & _U32) ^ _SEED_SALT)
    key = mix_u32_int(key ^ (seed >> 32))
    return mix_u32_int(key ^ (counter & _U32))


def counter_uniforms(keys: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in (0, 1) [B, V]: hash(row key, vocab id), top 24 bits, centred in their cell."""
    bits = mix_u32(keys[:, None] ^ salt[None, :]) >> 8
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


# ------------------------------------------------------------------------------------ packed rows
_WARP, _MASK_EOS, _GREEDY = 1, 2, 4
# int64 columns: draw key (row_key of seed and draw index), top-k, flags, then the padded penalty history
_KEY, _TOP_K, _FLAGS, _HISTORY = 0, 1, 2, 3
INT_COLUMNS = _HISTORY + PENALTY_WINDOW
# fp32 columns: temperature, penalty (1.0 when the penalty does not apply), top-p
FLOAT_COLUMNS = 3


def step_knobs(prm: SamplingParams, rule: StepRules, draw_index: int) -> tuple[list[int], list[float]]:
    """The history-free part of one row's step: ([key, top-k, flags], [temperature, penalty, top-p]).

    The one definition both the one-step packing (:func:`pack_row`) and the multi-step block packing
    (:mod:`services.talker.multistep`) use, so both hand the graph identical knobs for the same step.
    A penalty of exactly 1.0 is a bit-exact no-op whatever the history columns hold.
    """
    penalize = rule.apply_penalty and prm.repetition_penalty != 1.0
    key = 0 if prm.greedy else row_key(int(prm.seed), draw_index)
    flags = (_WARP if rule.apply_warpers else 0) | (_MASK_EOS if rule.mask_eos else 0)
    flags |= _GREEDY if prm.greedy else 0
    penalty = float(prm.repetition_penalty) if penalize else 1.0
    return [key, prm.top_k, flags], [float(prm.temperature), penalty, float(prm.top_p)]


def pack_row(
    row: RowState, rule: StepRules, vocab: int, consume_draw: bool = True
) -> tuple[list[int], list[float]]:
    """One row's knobs as (int64 columns, fp32 columns); a non-greedy row's draw counter advances here."""
    prm = row.params
    ints, floats = step_knobs(prm, rule, row.draws)
    if consume_draw and not prm.greedy:
        row.draws += 1
    if rule.apply_penalty and prm.repetition_penalty != 1.0:
        ints.extend(row.history[-PENALTY_WINDOW:])
    ints.extend([vocab] * (INT_COLUMNS - len(ints)))
    return ints, floats


def idle_row(vocab: int) -> tuple[list[int], list[float]]:
    """Harmless knobs for batch rows that sit out a step (greedy, nothing applied; the result is ignored)."""
    return [0, vocab, _GREEDY] + [vocab] * PENALTY_WINDOW, [1.0, 1.0, 1.0]


def pack_rows(
    rows: Sequence[RowState], rules: Sequence[StepRules], vocab: int, consume_draw: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors (int64 [B, INT_COLUMNS], fp32 [B, FLOAT_COLUMNS]) for :func:`sample_packed`."""
    packed = [pack_row(r, rule, vocab, consume_draw) for r, rule in zip(rows, rules, strict=True)]
    ints = torch.tensor([p[0] for p in packed], dtype=torch.int64).reshape(len(packed), INT_COLUMNS)
    floats = torch.tensor([p[1] for p in packed], dtype=torch.float32).reshape(len(packed), FLOAT_COLUMNS)
    return ints, floats


# -------------------------------------------------------------------------------- batched kernels
def _penalty_from_padded(logits: torch.Tensor, padded: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """``padded`` [B, W] holds each row's recent ids, padded with ``vocab`` (a dummy bin).

    A row with penalty 1 is returned unchanged bit for bit (1^n = 1, x·1 = x/1 = x).
    """
    bsz, vocab = logits.shape
    freq = torch.zeros(bsz, vocab + 1, dtype=logits.dtype, device=logits.device)
    freq.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    alpha = torch.pow(penalties[:, None].to(logits.dtype), freq[:, :vocab])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: torch.Tensor
) -> torch.Tensor:
    """Frequency penalty over each row's last ``PENALTY_WINDOW`` ids (rows with penalty 1 are untouched)."""
    vocab = logits.shape[1]
    padded = [list(h)[-PENALTY_WINDOW:] for h in histories]
    padded = [h + [vocab] * (PENALTY_WINDOW - len(h)) for h in padded]
    index = torch.tensor(padded, dtype=torch.long, device=logits.device).reshape(len(padded), PENALTY_WINDOW)
    return _penalty_from_padded(logits, index, penalties.to(logits.device))


def _top_p_removed(
    logits: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' top-p in ascending sorted order: (removed flags, sorted values, sort indices).

    The removed tokens are always a prefix of the ascending order (the cumulative mass only grows).
    """
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p[:, None])
    remove[:, -MIN_TOKENS_TO_KEEP:] = False
    remove = remove & (top_p[:, None] < 1.0)
    return remove, sorted_logits, sorted_idx


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """transformers ``TopPLogitsWarper(min_tokens_to_keep=3)`` with a per-row p (p = 1 keeps all)."""
    remove, _, sorted_idx = _top_p_removed(logits, top_p)
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    """transformers ``TopKLogitsWarper(min_tokens_to_keep=3)`` with a per-row k (k ≥ vocab keeps all)."""
    vocab = logits.shape[-1]
    k = torch.clamp(top_k, min=MIN_TOKENS_TO_KEEP, max=vocab).to(torch.long)
    if k_max is None:
        k_max = int(k.max())
    k_max = min(max(k_max, MIN_TOKENS_TO_KEEP), vocab)
    best = torch.topk(logits, k_max, dim=-1).values  # sorted descending; k_max is small (25) in practice
    threshold = best.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_warpers(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``apply_top_k(apply_top_p(x))`` from a single sort, with no host sync (graph-capturable).

    Top-p removes an ascending prefix of ``r`` tokens, so the top-p-masked row sorted descending is the
    original sorted row with its last ``r`` entries at −inf; its k-th largest value — top-k's threshold —
    is therefore ``sorted_ascending[V − k]`` when ``k ≤ V − r`` and −inf otherwise. Same kept set as the
    two warpers applied one after the other (ties with the k-th value kept).
    """
    vocab = logits.shape[-1]
    remove, sorted_logits, sorted_idx = _top_p_removed(logits, top_p)
    kept = vocab - remove.sum(dim=-1, keepdim=True)
    k = torch.clamp(top_k, min=MIN_TOKENS_TO_KEEP, max=vocab).to(torch.long)[:, None]
    kth = sorted_logits.gather(1, vocab - k)
    threshold = torch.where(k <= kept, kth, torch.full_like(kth, float("-inf")))
    mask = remove.scatter(1, sorted_idx, remove) | (logits < threshold)
    return logits.masked_fill(mask, float("-inf"))


def process_packed(
    logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, eos_id: int
) -> torch.Tensor:
    """Steps 1–4 on packed rows: the fp32 scores the draw is made from. Fixed shapes, no host decisions."""
    vocab = logits.shape[-1]
    flags = ints[:, _FLAGS]
    scores = logits.float() / floats[:, 0:1]
    scores = _penalty_from_padded(scores, ints[:, _HISTORY:], floats[:, 1])
    warped = apply_warpers(scores, floats[:, 2], ints[:, _TOP_K])
    scores = torch.where((flags & _WARP).bool()[:, None], warped, scores)
    eos_column = torch.arange(vocab, device=logits.device) == eos_id
    return scores.masked_fill((flags & _MASK_EOS).bool()[:, None] & eos_column[None, :], float("-inf"))


def pick_packed(scores: torch.Tensor, ints: torch.Tensor, salt: torch.Tensor | None = None) -> torch.Tensor:
    """Step 5: Gumbel-max with counter-based uniforms per row (argmax of the softmax for greedy rows)."""
    if salt is None:
        salt = vocab_salt(scores.shape[-1], scores.device)
    gumbel = -torch.log(-torch.log(counter_uniforms(ints[:, _KEY], salt)))
    sampled = torch.argmax(scores + gumbel, dim=-1)
    greedy = torch.argmax(torch.softmax(scores, dim=-1), dim=-1)
    return torch.where((ints[:, _FLAGS] & _GREEDY).bool(), greedy, sampled)


def sample_packed(
    logits: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    eos_id: int,
    salt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 1–5 for a batch of packed rows; returns the picked ids on the logits' device.

    The one function both paths run: eagerly on CPU and after a prefill, captured inside the decode
    CUDA graph on GPU. ``salt`` (:func:`vocab_salt`) must be passed when capturing.
    """
    return pick_packed(process_packed(logits, ints, floats, eos_id), ints, salt)


# ----------------------------------------------------------------------------- list-based helpers
def process_logits(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    rules: Sequence[StepRules],
    eos_id: int,
) -> torch.Tensor:
    """Steps 1–4 for a batch: the final scores the draw is made from (fp32; no draw is consumed)."""
    ints, floats = pack_rows(rows, rules, logits.shape[-1], consume_draw=False)
    return process_packed(logits, ints.to(logits.device), floats.to(logits.device), eos_id)


def draw(scores: torch.Tensor, rows: Sequence[RowState]) -> list[int]:
    """Step 5 alone on already-processed scores (one draw per non-greedy row)."""
    neutral = StepRules(apply_penalty=False, apply_warpers=False, mask_eos=False)
    ints, _ = pack_rows(rows, [neutral] * len(rows), scores.shape[-1])
    return [int(x) for x in pick_packed(scores, ints.to(scores.device)).tolist()]


def sample(
    logits: torch.Tensor, rows: Sequence[RowState], rules: Sequence[StepRules], eos_id: int
) -> list[int]:
    """One batched sampling step; the caller records kept frames with ``RowState.remember``."""
    ints, floats = pack_rows(rows, rules, logits.shape[-1])
    picked = sample_packed(logits, ints.to(logits.device), floats.to(logits.device), eos_id)
    return [int(x) for x in picked.tolist()]
