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


# ---- device sampler: packed rows, counter-based draws -----------------------------------------------
def test_hash_matches_python_integers() -> None:
    values = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]

    def mix(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x045D9F3B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    got = smp.mix_u32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix(v) for v in values] == [smp.mix_u32_int(v) for v in values]
    assert len(set(smp.mix_u32(torch.arange(1 << 16)).tolist())) == 1 << 16  # bijective on a range


def test_counter_uniforms_are_open_unit_interval_and_flat() -> None:
    keys = torch.tensor([smp.row_key(seed, 7 * seed) for seed in range(64)])
    assert len(set(keys.tolist())) == 64
    u = smp.counter_uniforms(keys, smp.vocab_salt(VOCAB))
    assert u.shape == (64, VOCAB) and float(u.min()) > 0.0 and float(u.max()) < 1.0
    hist = torch.histc(u.flatten(), bins=10, min=0.0, max=1.0) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.005  # 420k draws: every decile within 5 % of its share
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.05  # rows independent


def test_fused_warpers_equal_top_p_then_top_k() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    logits[1] = torch.round(logits[1])  # many exact ties, including at the k-th value
    logits[2, :100] = float("-inf")
    top_p = torch.tensor([0.85, 0.85, 0.5, 1.0, 0.01, 0.99])
    top_k = torch.tensor([25, 25, 3, VOCAB, 1, 200])
    expected = smp.apply_top_k(smp.apply_top_p(logits, top_p), top_k)
    assert torch.equal(smp.apply_warpers(logits, top_p, top_k), expected)


def _mixed_rows() -> tuple[list[smp.RowState], list[smp.StepRules]]:
    rows = [
        _row(seed=11),
        _row(seed=12, temperature=1.3, top_p=0.6, top_k=7),
        _row(seed=13, repetition_penalty=1.3),
        _row(seed=14, greedy=True),
        _row(seed=15, temperature=0.5),
    ]
    for i, r in enumerate(rows):
        r.history.extend([(5 * i + j) % 40 for j in range(20)])
    rules = [
        smp.StepRules(True, True, True),  # whole utterance mid-floor
        smp.StepRules(True, True, False),
        smp.duplex_rules(3, smp.duplex_budget(False, False)),  # penalty only, EOS masked
        smp.StepRules(True, True, False),
        smp.StepRules(False, False, False),  # a stream's first sample: temperature only
    ]
    return rows, rules


def test_packed_processing_follows_each_rule_per_row() -> None:
    rows, rules = _mixed_rows()
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 2
    logits[:, :40] += 4.0  # the penalised ids sit among the likely ones
    scores = smp.process_logits(logits, rows, rules, EOS)
    for i, (r, rule) in enumerate(zip(rows, rules, strict=True)):
        p = r.params
        want = logits[i : i + 1] / p.temperature
        if rule.apply_penalty:
            want = smp.apply_repetition_penalty(want, [r.history], torch.tensor([p.repetition_penalty]))
        if rule.apply_warpers:
            want = smp.apply_top_k(smp.apply_top_p(want, torch.tensor([p.top_p])), torch.tensor([p.top_k]))
        if rule.mask_eos:
            want[0, EOS] = float("-inf")
        assert torch.equal(scores[i : i + 1], want), f"row {i}"
    assert all(r.draws == 0 for r in rows)  # processing alone consumes no draw


def test_device_sampler_is_batch_invariant_and_counter_driven() -> None:
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(5, VOCAB, generator=gen) for _ in range(12)]

    def run(order: list[int]) -> dict[int, list[int]]:
        rows, rules = _mixed_rows()
        out: dict[int, list[int]] = {i: [] for i in order}
        for logits in steps:
            picked = smp.sample(logits[order], [rows[i] for i in order], [rules[i] for i in order], EOS)
            for i, code in zip(order, picked, strict=True):
                out[i].append(code)
        return out

    together = run([0, 1, 2, 3, 4])
    shuffled = run([3, 0, 4, 2, 1])
    for i in range(5):
        assert together[i] == shuffled[i] == run([i])[i]  # alone, crowded, reordered: same draws
    assert len(set(together[0])) > 3  # really random over steps (the draw counter advances)
    assert all(c != EOS for c in together[0] + together[2])  # EOS-masked rows
    rows, _ = _mixed_rows()
    assert [r.draws for r in rows] == [0] * 5
    smp.sample(steps[0], rows, _mixed_rows()[1], EOS)
    assert [r.draws for r in rows] == [1, 1, 1, 0, 1]  # greedy rows draw nothing


def test_gumbel_draw_matches_softmax_probabilities() -> None:
    logits = torch.full((1, 8), float("-inf"))  # a small vocab keeps the 20k draws cheap
    logits[0, :4] = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    row = _row(seed=99)
    ints, _ = smp.pack_rows([row], [smp.StepRules(False, False, False)], 8, consume_draw=False)
    batch = ints.repeat(20000, 1)
    batch[:, 0] = torch.tensor([smp.row_key(99, c) for c in range(20000)])  # successive draws of one request
    picks = smp.pick_packed(logits.expand(20000, -1), batch)
    freq = torch.bincount(picks, minlength=8).float() / 20000
    assert float((freq[:4] - torch.tensor([0.1, 0.2, 0.3, 0.4])).abs().max()) < 0.012  # ≈ 3.5 σ
    assert float(freq[4:].sum()) == 0.0
