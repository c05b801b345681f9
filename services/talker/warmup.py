"""Scratch streams through the whole talker engine before the server takes traffic.

Why: the runner's start-up warm-ups (``warmup_prefill``, ``warmup_graphs``) cover the prefill forward and
the decode graphs, not the eager rest of a prefill step: building the condition rows (text embedding, the
thinker-hidden projector), sampling after the prefill, cutting windows. Their CUDA kernels load lazily on
first launch (the efficient-attention kernel's first call took 35 ms in ``bench/gpu/sdpa_probe.py``) and new
shapes ask the allocator for blocks. Running the engine's own path once per burst size, on its thread,
moves that to start-up (0.4-2.8 s on the H200).

The large first-request stall of the talker (0.7-1.7 s for one stream, then 60 ms per new burst shape)
was cuDNN attention planning every new prefill shape; :mod:`services.common.sdpa` keeps prefill off
cuDNN, which no warm-up could have covered (the shapes are the requests').
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from services.talker.engine import TalkerEngine
from services.talker.streams import ClosedOut, ConditionInput, Output


def warm_up_streams(
    engine: TalkerEngine,
    bursts: Sequence[int],
    chunk_tokens: int = 12,
    max_frames: int = 24,
    timeout_s: float = 120.0,
) -> int:
    """Run bursts of ``bursts[i]`` scratch streams through the started ``engine``; returns the streams.

    On the engine's own thread, through its public commands (torch keeps CUDA library handles such as
    cuBLAS's per thread, so a warm-up on another thread would leave them to the first request). Even streams take the streaming form (a chunk, then the
    last chunk), odd ones the whole-utterance form (one last chunk), each at most ``max_frames`` frames;
    every stream is ended and waited for until the engine has closed it, so the engine ends with all
    slots free and no stream. Its metrics count these streams like any other.
    """
    if not engine.running:
        raise RuntimeError("warm_up_streams runs on the engine thread: call engine.start() first")
    gen = torch.Generator().manual_seed(0)
    cfg = engine.cfg
    ran = 0

    def condition(last: bool) -> ConditionInput:
        ids = torch.randint(0, cfg.num_text_tokens, (chunk_tokens,), generator=gen)
        hidden = torch.randn(chunk_tokens, cfg.llm_dim, generator=gen)
        return ConditionInput(ids, hidden, last, last, 0, 1, 0)

    for n in bursts:
        closed = threading.Semaphore(0)

        def emit(out: Output, closed: threading.Semaphore = closed) -> None:
            if isinstance(out, ClosedOut):
                closed.release()

        streams = []
        for i in range(min(n, engine.runner.cache.num_slots)):
            settings = engine.make_settings(request_id=f"warm-up-{n}-{i}", max_new_frames=max_frames)
            st = engine.open(settings, emit)
            if i % 2 == 0:
                engine.chunk(st, condition(False))
            engine.chunk(st, condition(True))
            engine.end(st)
            streams.append(st)
        deadline = time.monotonic() + timeout_s
        for _ in streams:
            if not closed.acquire(timeout=max(0.0, deadline - time.monotonic())):
                for st in streams:
                    engine.close(st)
                raise RuntimeError(f"talker warm-up: a burst of {len(streams)} streams did not finish")
        ran += len(streams)
    return ran
