"""Talker sampling rules, one by one, against hand-computed values and transformers' reference warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from services.talker import sampling as smp

EOS = 6561
VOCAB = 6562


def _row(seed: int = 0, greedy: bool = False, **kw: float) -> smp.RowState:
    params = dict(temperature=0.8, top_p=0.85, top_k=25, repetition_penalty=1.05, seed=seed, greedy=greedy)
    params.update(kw)
    return smp.RowState(smp.SamplingParams(**params))  # type: ignore[arg-type]


def test_repetition_penalty_counts_only_the_last_16_frames() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    history = [4] * 5 + [0, 0, 1, 1, 1] + [3] * 11  # 21 frames: the five 4s fall outside the window
    out = smp.apply_repetition_penalty(logits, [history], torch.tensor([1.05]))
    window = history[-16:]
    expected = []
    for tok, value in enumerate(logits[0].tolist()):
        alpha = 1.05 ** window.count(tok)
        expected.append(value * alpha if value < 0 else value / alpha)
    assert window.count(4) == 0 and window.count(1) == 3
    torch.testing.assert_close(out[0], torch.tensor(expected), rtol=0, atol=1e-6)
    assert out[0, 4] == logits[0, 4]  # id 4 repeated, but only before the window


def test_repetition_penalty_is_per_row_and_identity_at_one() -> None:
    logits = torch.randn(3, 50)
    hist = [[1, 2, 2], [], [7] * 16]
    out = smp.apply_repetition_penalty(logits, hist, torch.tensor([1.05, 1.05, 1.0]))
    assert torch.equal(out[1], logits[1])  # empty history
    assert torch.equal(out[2], logits[2])  # penalty 1
    assert out[0, 2] != logits[0, 2]


@pytest.mark.parametrize("top_p,top_k", [(0.85, 25), (0.5, 3), (0.99, 100), (0.01, 1)])
def test_warpers_match_transformers_with_min_keep_3(top_p: float, top_k: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    ref = TopKLogitsWarper(top_k, min_tokens_to_keep=3)(
        None, TopPLogitsWarper(top_p, min_tokens_to_keep=3)(None, logits)
    )
    ours = smp.apply_top_k(smp.apply_top_p(logits, torch.full((4,), top_p)), torch.full((4,), top_k))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert int((~torch.isinf(ours)).sum(dim=1).min()) >= 3


def test_warpers_take_per_row_parameters() -> None:
    logits = torch.randn(2, VOCAB)
    out = smp.apply_top_k(smp.apply_top_p(logits, torch.tensor([1.0, 0.85])), torch.tensor([VOCAB, 25]))
    assert torch.equal(out[0], logits[0])  # p = 1 and k = vocab keep everything
    assert int((~torch.isinf(out[1])).sum()) <= 25


def test_step_zero_is_raw_temperature_only() -> None:
    rules = smp.whole_utterance_rules(0, 50)
    assert not rules.apply_penalty and not rules.apply_warpers and rules.mask_eos
    row = _row()
    row.history.extend([3, 3, 3])
    logits = torch.randn(1, VOCAB)
    scores = smp.process_logits(logits, [row], [smp.StepRules(False, False, False)], EOS)
    torch.testing.assert_close(scores, logits / 0.8)
    later = smp.whole_utterance_rules(1, 50)
    assert later.apply_penalty and later.apply_warpers


def test_min_frames_mask_eos_then_release() -> None:
    assert all(smp.whole_utterance_rules(t, 50).mask_eos for t in range(50))
    assert not smp.whole_utterance_rules(50, 50).mask_eos
    assert smp.whole_utterance_rules(500, 50, never_stop=True).mask_eos
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    row = _row(greedy=True)
    assert smp.sample(logits, [row], [smp.whole_utterance_rules(10, 50)], EOS) != [EOS]
    assert smp.sample(logits, [row], [smp.whole_utterance_rules(60, 50)], EOS) == [EOS]


def test_streaming_rules_only_first_sample_of_stream_is_raw() -> None:
    assert smp.streaming_chunk_rules(0, 0) == smp.StepRules(False, False, False)
    assert smp.streaming_chunk_rules(12, 0) == smp.StepRules(True, True, False)
    assert smp.streaming_chunk_rules(0, 1) == smp.StepRules(True, True, False)


def test_duplex_budgets_and_eos_masking() -> None:
    mid = smp.duplex_budget(turn_start=False, turn_end=False)
    assert (mid.max_samples, mid.min_samples, mid.max_frames) == (26, 26, 25)
    assert all(smp.duplex_rules(t, mid).mask_eos for t in range(26))
    start = smp.duplex_budget(turn_start=True, turn_end=False)
    assert start.min_samples == 0 and not smp.duplex_rules(0, start).mask_eos
    end = smp.duplex_budget(turn_start=False, turn_end=True)
    assert (end.max_samples, end.min_samples) == (104, 0)
    masked = [t for t in range(104) if smp.duplex_rules(t, end).mask_eos]
    assert masked == [*range(25, 30), *range(50, 55), *range(75, 80), *range(100, 104)]
    # duplex applies temperature + penalty only, never the warpers; no penalty on a unit's first sample
    assert all(not smp.duplex_rules(t, mid).apply_warpers for t in range(26))
    assert not smp.duplex_rules(0, mid).apply_penalty and smp.duplex_rules(1, mid).apply_penalty


def test_seeded_draws_are_reproducible_and_seed_dependent() -> None:
    logits = torch.randn(1, VOCAB)
    rule = [smp.StepRules(True, True, True)]

    def run(seed: int) -> list[int]:
        row = _row(seed=seed)
        return [smp.sample(logits, [row], rule, EOS)[0] for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_draw_never_returns_masked_or_filtered_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [_row(seed=s) for s in range(8)]
    for _ in range(50):
        logits = torch.randn(8, VOCAB, generator=gen)
        logits[:, EOS] = 50.0
        scores = smp.process_logits(logits, rows, [smp.StepRules(True, True, True)] * 8, EOS)
        picks = smp.draw(scores, rows)
        for i, p in enumerate(picks):
            assert p != EOS and torch.isfinite(scores[i, p])


def test_draw_follows_the_distribution() -> None:
    logits = torch.full((1, 10), float("-inf"))
    logits[0, 2], logits[0, 7] = 0.0, torch.log(torch.tensor(3.0))
    row = _row(seed=3)
    counts = {2: 0, 7: 0}
    for _ in range(2000):
        counts[smp.draw(logits, [row])[0]] += 1
    assert 0.70 < counts[7] / 2000 < 0.80  # p = 0.75
