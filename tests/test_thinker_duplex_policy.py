"""The batched duplex policy against a row-at-a-time reading of docs/model.md, Duplex.

``reference_choose`` is the rule written the plain way (one row, host-side branches, a full-vocabulary
top-p); the batched device implementation must give the same greedy tokens on every row of a mixed batch,
draw sampled tokens with the right distribution, and keep a seeded session's draws independent of what
else shares its step.
"""

from __future__ import annotations

from collections import Counter

import torch

from services.thinker.duplex_policy import (
    CHUNK_EOS,
    CHUNK_TTS_EOS,
    LISTEN,
    TTS_BOS,
    TURN_EOS,
    TURN_EOS_LENGTH_PENALTY,
    UNIT_TERMINATORS,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
)
from services.thinker.sampling import Sampler, SamplingConfig, choose_tokens

VOCAB = 151748


def _forbidden() -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[[7, 500, 151_700]] = True
    return mask


def reference_choose(p: DuplexPolicy, logits: torch.Tensor, num_generated: int) -> int:
    """Greedy duplex policy (docs/model.md, Duplex) for one row, branch by branch (updates ``p.state`` like
    the engine's policy)."""
    if p.force_listen:
        return LISTEN
    forced_now = p.force_speak and num_generated == 0
    if not forced_now and int(torch.argmax(logits)) == CHUNK_EOS:
        return CHUNK_EOS
    masked = logits.masked_fill(p.forbidden.cpu(), float("-inf"))
    masked[CHUNK_EOS] = float("-inf")
    if forced_now:
        masked[LISTEN] = float("-inf")
        masked[CHUNK_TTS_EOS] = float("-inf")
    s = p.sampling
    if s.repetition_penalty != 1.0 and p.state.history:
        ids = torch.tensor(sorted(set(p.state.history[-s.penalty_window :])))
        masked[ids] = masked[ids] / s.repetition_penalty
    t = float(masked[TURN_EOS])
    masked[TURN_EOS] = t / TURN_EOS_LENGTH_PENALTY if t > 0 else t * TURN_EOS_LENGTH_PENALTY
    token = int(torch.argmax(masked))
    p.state.history.append(token)  # every drawn id, before the listen replacement (upstream's decode)
    if token == LISTEN and not p.state.turn_ended:
        token = TTS_BOS
    if token not in UNIT_TERMINATORS:
        p.state.turn_ended = token == TURN_EOS
    return token


def _greedy(state: PolicyState, **kw: bool) -> DuplexPolicy:
    args = {"force_listen": False, "force_speak": False} | kw
    return DuplexPolicy(DuplexSampling(temperature=0.0, repetition_penalty=1.3), state, _forbidden(), **args)


def test_batched_greedy_rows_match_the_row_at_a_time_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        logits = torch.randn(8, VOCAB, generator=gen)
        # Make the special decisions competitive so every branch is taken somewhere.
        logits[:, [LISTEN, TURN_EOS, CHUNK_EOS, CHUNK_TTS_EOS, 500]] += (
            torch.randn(8, 5, generator=gen) * 3 + 3
        )
        logits[0, CHUNK_EOS] = 50.0  # the model's own stop
        logits[1, CHUNK_EOS] = 50.0  # ... ignored on a forced speak's first token
        logits[2, 500] = 60.0  # a forbidden id never comes out
        logits[3, LISTEN] = 40.0  # listen while the turn is open -> <|tts_bos|>
        logits[4, TURN_EOS] = -0.01  # a negative <|turn_eos|> logit is multiplied by the length penalty
        hist = torch.randint(0, 1000, (40,), generator=gen).tolist()
        top = int(torch.argmax(logits[5, :1000]))
        logits[5, top] += 0.1
        specs = [
            ({}, PolicyState(), 3),
            ({"force_speak": True}, PolicyState(), 0),
            ({}, PolicyState(), 1),
            ({}, PolicyState(turn_ended=False), 2),
            ({}, PolicyState(), 4),
            ({}, PolicyState(history=hist + [top]), 5),
            ({"force_listen": True}, PolicyState(), 0),
            ({"force_speak": True}, PolicyState(history=hist), 0),
        ]
        batched = [_greedy(PolicyState(st.turn_ended, list(st.history)), **kw) for kw, st, _ in specs]
        single = [_greedy(PolicyState(st.turn_ended, list(st.history)), **kw) for kw, st, _ in specs]
        got = DuplexPolicy.choose_rows(batched, logits.clone(), [[]] * 8, [g for _, _, g in specs])
        want = [reference_choose(p, logits[i].clone(), specs[i][2]) for i, p in enumerate(single)]
        assert got == want, f"trial {trial}"
        assert [p.state.history for p in batched] == [p.state.history for p in single]
        assert [p.state.turn_ended for p in batched] == [p.state.turn_ended for p in single]
    assert got[0] == CHUNK_EOS and got[1] != CHUNK_EOS and got[2] != 500 and got[3] == TTS_BOS
    assert got[6] == LISTEN


def test_sampled_rows_follow_temperature_top_k_top_p() -> None:
    # Five candidates; top-k 4 drops the last; over the renormalised four, the better-ranked mass before the
    # candidates is 0, 0.42, 0.73, 0.94, so top-p 0.8 keeps the best three.
    logits = torch.full((VOCAB,), -1e4)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    cand = [11, 12, 13, 14, 15]
    logits[cand] = probs.log()
    sampling = DuplexSampling(temperature=1.0, top_k=4, top_p=0.8, repetition_penalty=1.0, seed=1234)
    policy = DuplexPolicy(
        sampling, PolicyState(), torch.zeros(VOCAB, dtype=torch.bool), force_listen=False, force_speak=False
    )
    n = 4000
    draws: Counter[int] = Counter()
    for _ in range(n // 50):
        draws.update(
            DuplexPolicy.choose_rows([policy] * 50, logits.expand(50, VOCAB).clone(), [[]] * 50, [1] * 50)
        )
    assert set(draws) <= {11, 12, 13}
    kept = probs[:3] / probs[:3].sum()
    for tok, p in zip((11, 12, 13), kept.tolist(), strict=True):
        assert abs(draws[tok] / n - p) < 0.03, (tok, draws[tok] / n, p)


def test_seeded_session_draws_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(3, VOCAB, generator=gen) * 4 for _ in range(12)]

    def run(batch: bool) -> list[int]:
        seeded = DuplexPolicy(
            DuplexSampling(seed=99), PolicyState(), _forbidden(), force_listen=False, force_speak=False
        )
        others = [
            DuplexPolicy(DuplexSampling(), PolicyState(), _forbidden(), force_listen=False, force_speak=False)
            for _ in range(2)
        ]
        out = []
        for k, logits in enumerate(steps):
            if batch:
                out.append(
                    DuplexPolicy.choose_rows(
                        [others[0], seeded, others[1]], logits.clone(), [[]] * 3, [k + 1] * 3
                    )[1]
                )
            else:
                out.append(seeded.choose(logits[1].clone(), [], k + 1))
        return out

    alone = run(batch=False)
    assert run(batch=True) == alone and run(batch=False) == alone
    assert len(set(alone)) > 1


def test_choose_tokens_groups_rows_by_sampler_class() -> None:
    """Plain greedy rows, per-row samplers and duplex rows in one step each get their own rule."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen)
    logits[0, CHUNK_EOS] = 30.0
    plain = Sampler(SamplingConfig())
    penalised = Sampler(SamplingConfig(repetition_penalty=1e6))
    duplex = [_greedy(PolicyState()) for _ in range(2)]
    best2 = int(torch.argmax(logits[2]))
    tokens = choose_tokens(
        [duplex[0], plain, penalised, duplex[1]], logits, [[], [], [best2], []], [1, 1, 1, 1]
    )
    assert tokens[0] == CHUNK_EOS
    assert tokens[1] == int(torch.argmax(logits[1]))
    assert tokens[2] != best2
    assert tokens[3] == reference_choose(_greedy(PolicyState()), logits[3].clone(), 1)
