"""Scratch streams through the whole talker engine before the server takes traffic.

Why: the runner's start-up warm-ups (``warmup_prefill``, ``warmup_graphs``) cover the prefill forward and
the decode graphs, yet on the H200 the first prefill *step* of a started server still took ~1 s (one
stream) and the first c=8 burst's ~96 ms against ~65-73 ms for later bursts (BENCHMARKS.md, session 10,
the talker's slow-step log). The rest of a prefill step runs eager torch code that no runner warm-up
touches: building the condition rows (text embedding, the thinker-hidden projector), sampling after the
prefill, cutting windows. Each CUDA kernel there loads lazily on its first launch and each new shape
asks the allocator for new blocks; a stream that runs the engine's own path once per burst size pays
that here instead of inside the first requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.talker.engine import TalkerEngine
from services.talker.streams import ConditionInput, Output


def warm_up_streams(
    engine: TalkerEngine, bursts: Sequence[int], chunk_tokens: int = 12, max_frames: int = 24
) -> int:
    """Run bursts of ``bursts[i]`` scratch streams through ``engine`` (not yet started); returns the streams.

    Even streams take the streaming form (a chunk, then the last chunk), odd ones the whole-utterance
    form (one last chunk), each at most ``max_frames`` frames; every stream is closed again, so the
    engine ends with all slots free and no stream. Its metrics count these streams like any other.
    """
    if engine.running:
        raise RuntimeError("warm_up_streams drives the engine itself: call it before engine.start()")
    gen = torch.Generator().manual_seed(0)
    cfg = engine.cfg
    ran = 0

    def condition(last: bool) -> ConditionInput:
        ids = torch.randint(0, cfg.num_text_tokens, (chunk_tokens,), generator=gen)
        hidden = torch.randn(chunk_tokens, cfg.llm_dim, generator=gen)
        return ConditionInput(ids, hidden, last, last, 0, 1, 0)

    for n in bursts:
        sink: list[Output] = []
        streams = []
        for i in range(min(n, engine.runner.cache.num_slots)):
            settings = engine.make_settings(request_id=f"warm-up-{n}-{i}", max_new_frames=max_frames)
            st = engine.open(settings, sink.append)
            if i % 2 == 0:
                engine.chunk(st, condition(False))
            engine.chunk(st, condition(True))
            streams.append(st)
        engine.run_until_idle()
        for st in streams:
            engine.close(st)
        engine.run_until_idle()
        ran += len(streams)
    return ran
