"""Code2Wav's first-window lane on the tiny checkpoint (CPU): a stream's first window runs beside a batch
that is still running instead of waiting for it, its audio is the main loop's, and the lane's runner has
entry points of its own (the GPU gives each its own CUDA graphs)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path

import numpy as np

from services.common.checkpoint import CODEC_SILENCE_ID

CODES = [(i * 811) % 6561 for i in range(60)]
FIRST = [CODEC_SILENCE_ID] * 3 + CODES[:10]  # a 10-code first window, as the profiles' talker sends
SECOND = FIRST[-3:] + CODES[10:35]


def _args(ckpt: Path, lane: int) -> argparse.Namespace:
    return argparse.Namespace(
        checkpoint=str(ckpt),
        device="cpu",
        max_batch=4,
        max_streams=4,
        cfm_steps=10,
        cache_dtype="float32",
        nsf_noise="off",
        cuda_graphs="off",
        voice_cache=4,
        first_window_lane=lane,
    )


def _lane_windows() -> float:
    from services.code2wav.engine import LANE_BATCH_SIZE

    return float(LANE_BATCH_SIZE._sum.get())


def test_a_first_window_runs_while_the_main_batch_is_held(tiny_ckpt: Path) -> None:
    """Stream a's second window holds the main loop (its runner waits on an event); stream b's first
    window must still come back, from the lane, before that batch is let go."""
    from services.code2wav.service import build_engine

    async def scenario() -> None:
        engine, _ = build_engine(_args(tiny_ckpt, lane=2))
        assert engine.lane is not None and engine.lane is not engine.runner
        await engine.start()
        release = threading.Event()
        main_run = engine.runner.run

        def held_run(items):  # noqa: ANN001, ANN202
            release.wait(300)
            return main_run(items)

        engine.runner.run = held_run  # type: ignore[method-assign]
        try:
            before = _lane_windows()
            a = await engine.open_stream("a", None, seed=1)
            engine.submit(a, FIRST, 3, False, "a0")
            tag, res = await asyncio.wait_for(a.outputs.get(), 300)  # first window: the lane, not held
            assert tag == "a0" and res.samples.shape[0] > 0
            engine.submit(a, SECOND, 3, False, "a1")  # a later window: the main loop, held
            await asyncio.sleep(0.05)
            assert a.in_flight and a.outputs.empty()
            b = await engine.open_stream("b", None, seed=2)  # opened on the lane, not behind the batch
            engine.submit(b, FIRST, 3, False, "b0")
            tag, res = await asyncio.wait_for(b.outputs.get(), 300)
            assert tag == "b0" and res.samples.shape[0] > 0
            assert a.outputs.empty()  # the main batch is still held
            assert _lane_windows() - before == 2
            release.set()
            tag, res = await asyncio.wait_for(a.outputs.get(), 300)
            assert tag == "a1" and res.samples.shape[0] == 25 * 2 * 480
        finally:
            release.set()
            await engine.stop()

    asyncio.run(scenario())


def test_lane_audio_is_the_main_loops(tiny_ckpt: Path) -> None:
    """The same windows through an engine with the lane and one without give the same samples: the lane's
    runner is the same model, and the state it hands to the main loop continues the stream exactly."""
    from services.code2wav.service import build_engine

    async def run(lane: int) -> list[np.ndarray]:
        engine, _ = build_engine(_args(tiny_ckpt, lane))
        await engine.start()
        out = []
        try:
            for seed in (1, 2):
                s = await engine.open_stream(f"s{seed}", None, seed=seed)
                for tag, window, last in (
                    ("0", FIRST, False),
                    ("1", SECOND, False),
                    ("2", SECOND[-3:], True),
                ):
                    engine.submit(s, window, 3, last, tag)
                    got, res = await asyncio.wait_for(s.outputs.get(), 300)
                    assert got == tag
                    out.append(res.samples)
        finally:
            await engine.stop()
        return out

    with_lane = asyncio.run(run(2))
    without = asyncio.run(run(0))
    assert len(with_lane) == len(without) == 6
    for a, b in zip(with_lane, without, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lane_copy_has_its_own_entry_points(tiny_ckpt: Path) -> None:
    """Graphs routed through the main runner (enable_cuda_graphs replaces the entry points) must not
    reach the lane's runner, which gets a graph set of its own; the model and the origin caches are
    shared."""
    from services.code2wav.service import build_engine

    engine, _ = build_engine(_args(tiny_ckpt, lane=0))
    runner = engine.runner
    lane = runner.lane_copy()
    marker = object()
    runner.flow.solver = marker  # type: ignore[assignment]
    runner.flow.encode = marker  # type: ignore[assignment]
    runner.vocoder.f0_fn = marker  # type: ignore[assignment]
    assert lane.flow.solver is not marker and lane.flow.encode is not marker
    assert lane.vocoder.f0_fn is not marker
    assert lane.model is runner.model and lane._origins is runner._origins
    assert lane.graph_sets == {} and lane.last_batch_sizes is not runner.last_batch_sizes
