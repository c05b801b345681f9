"""The fixed-shape draw that the duplex policy's CUDA graph captures, against the eager batched policy.

``draw_static`` is what a replay runs; on CPU it runs eagerly, so these tests hold its arithmetic and its
use of the generator to ``_policy_tokens`` (the eager path every non-captured step takes): the same
inputs and the same generator state must give the same tokens, row for row, greedy and sampled. The
replay itself needs CUDA; ``bench.duplex_policy`` compares it with the eager path on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.thinker.duplex_policy import (
    CHUNK_EOS,
    CHUNK_TTS_EOS,
    LISTEN,
    TURN_EOS,
    TURN_EOS_LENGTH_PENALTY,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
    _graph_tokens,
    _policy_tokens,
)
from services.thinker.duplex_policy_graph import PARAMS, _bucket, draw_static, graphs_for

VOCAB = 151748
WIDTH = 512
IDS = (CHUNK_EOS, LISTEN, CHUNK_TTS_EOS, TURN_EOS)


def _policies(sampled: bool) -> tuple[list[DuplexPolicy], list[int]]:
    forbidden = torch.zeros(VOCAB, dtype=torch.bool)
    forbidden[[7, 500, 151_700]] = True
    temp = 0.7 if sampled else 0.0
    rows = [
        (DuplexSampling(temperature=temp), list(range(100, 700)), False, 3),  # window longer than 512
        (DuplexSampling(temperature=temp, top_k=5, top_p=0.5), [42, 42, 9], False, 1),  # short, repeated
        (DuplexSampling(temperature=temp, repetition_penalty=1.0), [1, 2, 3], False, 2),  # no penalty
        (DuplexSampling(temperature=temp), [], True, 0),  # forced speak, first token, no history
        (DuplexSampling(temperature=temp, top_k=0), [CHUNK_EOS, 5], False, 4),  # top-k off
    ]
    out = []
    for sampling, history, forced, _ in rows:
        state = PolicyState(history=list(history))
        out.append(DuplexPolicy(sampling, state, forbidden, force_listen=False, force_speak=forced))
    return out, [g for *_, g in rows]


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g)
    # Each rule decides one row's greedy token: the window's penalty (rows 0, 1; a row without a penalty
    # keeps its best id, row 2), the forced speak's masks (row 3), the <|turn_eos|> length penalty (row 4).
    for row, cols in enumerate(([600, 50], [42, 43], [2, 60], [LISTEN, CHUNK_TTS_EOS, 70], [TURN_EOS, 80])):
        logits[row, cols] = torch.tensor([20.0, 19.5, 19.0][: len(cols)])
    logits[1, TURN_EOS] = -9.0  # a negative <|turn_eos|> logit is multiplied, not divided
    return logits


def _static_inputs(
    policies: list[DuplexPolicy], generated: list[int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The packed parameters and padded windows ``_graph_tokens`` hands to a replay, built the same way."""
    params = torch.zeros(len(policies), PARAMS)
    window_ids = torch.zeros(len(policies), WIDTH, dtype=torch.long)
    ks = []
    for r, (p, g) in enumerate(zip(policies, generated, strict=True)):
        s = p.sampling
        hist = p.state.history[-s.penalty_window :] if s.repetition_penalty != 1.0 else []
        if hist:
            window_ids[r, : len(hist)] = torch.tensor(hist)
            window_ids[r, len(hist) :] = hist[0]
        k = min(s.top_k, VOCAB) if s.top_k > 0 else VOCAB
        ks.append(k)
        params[r] = torch.tensor(
            [
                s.repetition_penalty if hist else 1.0,
                max(s.temperature, 1e-5),
                k,
                s.top_p,
                s.temperature > 0,
                p.force_speak and g == 0,
            ]
        )
    return params, window_ids, max(ks)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_static_draw_matches_the_eager_policy(sampled: bool, seed: int) -> None:
    policies, generated = _policies(sampled)
    logits = _logits(len(policies), seed)
    torch.manual_seed(100 + seed)
    eager = _policy_tokens(policies, logits.clone(), generated)
    params, window_ids, k = _static_inputs(policies, generated)
    forbidden = policies[0].forbidden.reshape(1, -1)
    torch.manual_seed(100 + seed)
    static = draw_static(logits.clone(), forbidden, window_ids, params, k, IDS, TURN_EOS_LENGTH_PENALTY)
    assert static.tolist() == eager
    if not sampled:
        assert eager == [50, 43, 2, 70, 80]  # each row's rule changed its argmax
    if not sampled:  # greedy rows do not depend on the generator: a fresh state gives the same tokens
        again = draw_static(logits.clone(), forbidden, window_ids, params, k, IDS, TURN_EOS_LENGTH_PENALTY)
        assert again.tolist() == eager


def test_static_draw_honours_the_forced_row_and_the_model_stop() -> None:
    policies, generated = _policies(False)
    logits = _logits(len(policies), 5)
    logits[:, CHUNK_EOS] = 100.0  # every row's raw draw is the model's stop ...
    params, window_ids, k = _static_inputs(policies, generated)
    forbidden = policies[0].forbidden.reshape(1, -1)
    tokens = draw_static(logits, forbidden, window_ids, params, k, IDS, TURN_EOS_LENGTH_PENALTY).tolist()
    assert tokens[:3] == [CHUNK_EOS] * 3 and tokens[4] == CHUNK_EOS
    assert tokens[3] not in (CHUNK_EOS, LISTEN, CHUNK_TTS_EOS)  # ... except the forced speak's first token


def test_graph_path_is_only_taken_for_captured_cuda_rows() -> None:
    policies, generated = _policies(True)
    assert graphs_for(policies[0].forbidden) is None  # nothing is captured on CPU
    assert _graph_tokens(policies, _logits(len(policies), 0), generated) is None
    assert [_bucket(n) for n in (1, 3, 16, 17, 64, 65)] == [1, 4, 16, 24, 64, None]
    assert np.float32(VOCAB) == VOCAB  # top-k widths travel as fp32 parameters: exact at this vocab
