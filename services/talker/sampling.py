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
    return StepRules(apply_penalty=not first, apply_warpers=not first, mask_eos=never_stop or t < min_new_frames)


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
def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: torch.Tensor
) -> torch.Tensor:
    """Frequency penalty over each row's last ``PENALTY_WINDOW`` ids (rows with penalty 1 are untouched)."""
    bsz, vocab = logits.shape
    width = max([min(len(h), PENALTY_WINDOW) for h in histories] + [1])
    padded = torch.full((bsz, width), vocab, dtype=torch.long)  # column `vocab` is a dummy bin
    for i, h in enumerate(histories):
        recent = list(h)[-PENALTY_WINDOW:]
        if recent:
            padded[i, : len(recent)] = torch.tensor(recent, dtype=torch.long)
    padded = padded.to(logits.device)
    freq = torch.zeros(bsz, vocab + 1, dtype=logits.dtype, device=logits.device)
    freq.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    alpha = torch.pow(penalties[:, None].to(logits.dtype), freq[:, :vocab])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """transformers ``TopPLogitsWarper(min_tokens_to_keep=3)`` with a per-row p (p = 1 keeps all)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p[:, None])
    remove[:, -MIN_TOKENS_TO_KEEP:] = False
    remove = remove & (top_p[:, None] < 1.0)
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """transformers ``TopKLogitsWarper(min_tokens_to_keep=3)`` with a per-row k (k ≥ vocab keeps all)."""
    vocab = logits.shape[-1]
    k = torch.clamp(top_k, min=MIN_TOKENS_TO_KEEP, max=vocab).to(torch.long)
    k_max = int(k.max())
    best = torch.topk(logits, k_max, dim=-1).values  # sorted descending; k_max is small (25) in practice
    threshold = best.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    rules: Sequence[StepRules],
    eos_id: int,
) -> torch.Tensor:
    """Steps 1–4 for a batch: returns the final scores the draw is made from (fp32, same shape)."""
    dev = logits.device
    scores = logits.float()
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev)
    scores = scores / temps[:, None]
    pen = [r.params.repetition_penalty if rule.apply_penalty else 1.0 for r, rule in zip(rows, rules, strict=True)]
    if any(p != 1.0 for p in pen):
        scores = apply_repetition_penalty(
            scores, [r.history for r in rows], torch.tensor(pen, dtype=torch.float32, device=dev)
        )
    if any(rule.apply_warpers for rule in rules):
        warp = torch.tensor([rule.apply_warpers for rule in rules], dtype=torch.bool, device=dev)
        top_p = torch.tensor(
            [r.params.top_p if rule.apply_warpers else 1.0 for r, rule in zip(rows, rules, strict=True)],
            dtype=torch.float32,
            device=dev,
        )
        top_k = torch.tensor(
            # rows without warpers are restored by the where() below; a small k keeps the top-k cheap
            [r.params.top_k if rule.apply_warpers else 1 for r, rule in zip(rows, rules, strict=True)],
            dtype=torch.long,
            device=dev,
        )
        warped = apply_top_k(apply_top_p(scores, top_p), top_k)
        scores = torch.where(warp[:, None], warped, scores)
    mask_eos = torch.tensor([rule.mask_eos for rule in rules], dtype=torch.bool, device=dev)
    if bool(mask_eos.any()):
        scores[:, eos_id] = torch.where(mask_eos, torch.full_like(scores[:, eos_id], float("-inf")), scores[:, eos_id])
    return scores


def draw(scores: torch.Tensor, rows: Sequence[RowState]) -> list[int]:
    """Step 5: softmax and one draw per row (inverse CDF with the row's own uniform; argmax if greedy)."""
    probs = torch.softmax(scores, dim=-1)
    greedy = [r.params.greedy for r in rows]
    uniforms = torch.tensor([0.0 if g else r.uniform() for r, g in zip(rows, greedy, strict=True)])
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(device=probs.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Guard the rounding edge (target ≥ the last cumulative value): fall back to the last token with mass.
    vocab = probs.shape[1]
    last_positive = (vocab - 1) - torch.argmax(torch.flip(probs > 0, dims=[1]).to(torch.int8), dim=1)
    picked = torch.minimum(picked, last_positive)
    argmax = torch.argmax(probs, dim=-1)
    greedy_t = torch.tensor(greedy, dtype=torch.bool, device=probs.device)
    out = torch.where(greedy_t, argmax, picked)
    return [int(x) for x in out.tolist()]


def sample(
    logits: torch.Tensor, rows: Sequence[RowState], rules: Sequence[StepRules], eos_id: int
) -> list[int]:
    """One batched sampling step; the caller records kept frames with ``RowState.remember``."""
    return draw(process_logits(logits, rows, rules, eos_id), rows)
