"""Codec sampling exactly as upstream MiniCPMTTS, batched over rows with per-row parameters.

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
units apply only the penalty (their warpers are built upstream but never called, model-spec §4.4 b).

The draw is inverse-CDF sampling with one uniform per row taken from the request's own
``torch.Generator`` (seeded per request), so a stream's samples depend only on its seed and its logits,
never on which other streams share the batch. ``greedy`` rows take the argmax instead (tests, fidelity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PENALTY_WINDOW = 16
MIN_TOKENS_TO_KEEP = 3

# Duplex budgets (model-spec §4.5): 26 samples per unit, the 26th dropped, so 25 frames ≈ 1 s.
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
    """Per-request sampling state: its params, its RNG and its penalty history (last frames only)."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(int(self.params.seed))

    def remember(self, code: int) -> None:
        self.history.append(int(code))
        if len(self.history) > PENALTY_WINDOW:
            del self.history[: len(self.history) - PENALTY_WINDOW]

    def clear_history(self) -> None:
        self.history.clear()

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


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
    """Samples allowed in one duplex unit and the EOS floor (model-spec §4.5, §6.4)."""

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


# -------------------------------------------------------------------------------- batched kernels
def _penalty_from_padded(logits: torch.Tensor, padded: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """``padded`` [B, W] holds each row's recent ids, padded with ``vocab`` (a dummy bin)."""
    bsz, vocab = logits.shape
    freq = torch.zeros(bsz, vocab + 1, dtype=logits.dtype, device=logits.device)
    freq.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    alpha = torch.pow(penalties[:, None].to(logits.dtype), freq[:, :vocab])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def _padded_histories(histories: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    width = max([min(len(h), PENALTY_WINDOW) for h in histories] + [1])
    out = []
    for h in histories:
        recent = list(h)[-PENALTY_WINDOW:]
        out.append(recent + [vocab] * (width - len(recent)))
    return out


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: torch.Tensor
) -> torch.Tensor:
    """Frequency penalty over each row's last ``PENALTY_WINDOW`` ids (rows with penalty 1 are untouched)."""
    padded = torch.tensor(
        _padded_histories(histories, logits.shape[1]), dtype=torch.long, device=logits.device
    )
    return _penalty_from_padded(logits, padded, penalties.to(logits.device))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """transformers ``TopPLogitsWarper(min_tokens_to_keep=3)`` with a per-row p (p = 1 keeps all)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p[:, None])
    remove[:, -MIN_TOKENS_TO_KEEP:] = False
    remove = remove & (top_p[:, None] < 1.0)
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


_WARP, _MASK_EOS, _GREEDY = 1, 2, 4


def _sample_packed(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    rules: Sequence[StepRules],
    eos_id: int,
    draw_uniforms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–5 with every per-row knob packed into two small tensors (two host→device copies per step).

    Returns (final scores, picked ids on the device).
    """
    dev = logits.device
    bsz, vocab = logits.shape
    penalize = [
        rule.apply_penalty and r.params.repetition_penalty != 1.0 for r, rule in zip(rows, rules, strict=True)
    ]
    floats: list[list[float]] = []
    ints: list[list[int]] = []
    hist = _padded_histories([r.history if p else [] for r, p in zip(rows, penalize, strict=True)], vocab)
    k_max = MIN_TOKENS_TO_KEEP
    for r, rule, pen, h in zip(rows, rules, penalize, hist, strict=True):
        prm = r.params
        flags = (_WARP if rule.apply_warpers else 0) | (_MASK_EOS if rule.mask_eos else 0)
        flags |= _GREEDY if prm.greedy else 0
        uniform = r.uniform() if draw_uniforms and not prm.greedy else 0.0
        floats.append([prm.temperature, prm.repetition_penalty if pen else 1.0, prm.top_p, uniform])
        top_k = prm.top_k if rule.apply_warpers else 1
        k_max = max(k_max, top_k)
        ints.append([top_k, flags, *h])
    f = torch.tensor(floats, dtype=torch.float32).to(dev, non_blocking=True)
    i = torch.tensor(ints, dtype=torch.long).to(dev, non_blocking=True)
    flags = i[:, 1]
    scores = logits.float() / f[:, 0:1]
    if any(penalize):
        scores = _penalty_from_padded(scores, i[:, 2:], f[:, 1])
    if any(rule.apply_warpers for rule in rules):
        warped = apply_top_k(apply_top_p(scores, f[:, 2]), i[:, 0], k_max)
        scores = torch.where((flags & _WARP).bool()[:, None], warped, scores)
    if any(rule.mask_eos for rule in rules):
        eos_col = scores[:, eos_id]
        scores[:, eos_id] = torch.where(
            (flags & _MASK_EOS).bool(), torch.full_like(eos_col, float("-inf")), eos_col
        )
    return scores, _pick(scores, f[:, 3], (flags & _GREEDY).bool())


def _pick(scores: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Softmax, then inverse-CDF with one uniform per row (argmax for greedy rows)."""
    probs = torch.softmax(scores, dim=-1)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    # Guard the rounding edge (target ≥ the last cumulative value): fall back to the last token with mass.
    vocab = probs.shape[1]
    last_positive = (vocab - 1) - torch.argmax(torch.flip(probs > 0, dims=[1]).to(torch.int8), dim=1)
    picked = torch.minimum(picked, last_positive)
    return torch.where(greedy, torch.argmax(probs, dim=-1), picked)


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    rules: Sequence[StepRules],
    eos_id: int,
) -> torch.Tensor:
    """Steps 1–4 for a batch: the final scores the draw is made from (fp32; no RNG is consumed)."""
    return _sample_packed(logits, rows, rules, eos_id, draw_uniforms=False)[0]


def draw(scores: torch.Tensor, rows: Sequence[RowState]) -> list[int]:
    """Step 5 alone on already-processed scores (one uniform per non-greedy row)."""
    greedy = [r.params.greedy for r in rows]
    uniforms = torch.tensor([0.0 if g else r.uniform() for r, g in zip(rows, greedy, strict=True)])
    picked = _pick(scores, uniforms.to(scores.device), torch.tensor(greedy, device=scores.device))
    return [int(x) for x in picked.tolist()]


def sample(
    logits: torch.Tensor, rows: Sequence[RowState], rules: Sequence[StepRules], eos_id: int
) -> list[int]:
    """One batched sampling step; the caller records kept frames with ``RowState.remember``."""
    return [int(x) for x in _sample_packed(logits, rows, rules, eos_id, draw_uniforms=True)[1].tolist()]
