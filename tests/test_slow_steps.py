"""services.common.slow_steps: a step over the threshold is logged with its phases and counted; the talker
engine's steps go through it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from services.common import slow_steps
from services.common.metrics import SLOW_STEPS
from services.common.slow_steps import StepTimer, threshold_ms


def _count(stage: str) -> float:
    return SLOW_STEPS.labels(stage)._value.get()


def test_a_slow_step_is_logged_with_its_phases(caplog: pytest.LogCaptureFixture) -> None:
    timer = StepTimer("unit-a", limit_ms=5.0)
    before = _count("unit-a")
    timer.start()
    timer.mark("commands")
    time.sleep(0.01)
    timer.mark("decode", batch=8, steps=4)
    with caplog.at_level(logging.WARNING, logger="services.common.slow_steps"):
        ms = timer.finish()
    assert ms is not None and ms >= 10
    assert _count("unit-a") == before + 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "unit-a: slow engine step" in line and "decode" in line and "(batch 8, steps 4)" in line
    timer.start()  # a fast step: nothing logged, nothing counted
    timer.mark("commands")
    assert timer.finish() is None and _count("unit-a") == before + 1


def test_a_callable_fact_is_read_only_when_the_step_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The thinker passes the device's forward time this way: reading it costs only on slow steps."""
    reads: list[int] = []

    def device_ms() -> str:
        reads.append(1)
        return "12.5"

    timer = StepTimer("unit-lazy", limit_ms=5.0)
    timer.start()
    timer.mark("sample and emit", device_forward_ms=device_ms)
    assert timer.finish() is None and reads == []  # fast: never read
    timer.start()
    time.sleep(0.01)
    timer.mark("sample and emit", device_forward_ms=device_ms)
    with caplog.at_level(logging.WARNING, logger="services.common.slow_steps"):
        assert timer.finish() is not None
    assert reads == [1]
    [line] = [r.getMessage() for r in caplog.records]
    assert "(device_forward_ms 12.5)" in line


def test_threshold_is_the_process_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage CLI configures it from ``--slow-step-ms`` (the profile's ``slow_step_ms``); timers built
    before that (the engine is built first) follow it."""
    monkeypatch.setattr(slow_steps, "_threshold_ms", slow_steps.DEFAULT_MS)
    assert threshold_ms() == 50.0
    timer = StepTimer("unit-b")
    slow_steps.configure(0)
    timer.start()
    time.sleep(0.002)
    assert timer.finish() is None  # 0: off
    slow_steps.configure(1.0)
    timer.start()
    time.sleep(0.002)
    assert timer.finish() is not None
    with pytest.raises(ValueError, match="slow_step_ms"):
        slow_steps.configure(-1)


def test_talker_engine_logs_slow_steps(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a threshold below any step, the talker's prefill and decode steps are logged as such."""
    from services.common.checkpoint import Checkpoint
    from services.talker.engine import TalkerEngine
    from services.talker.model.tts import MiniCPMTTS
    from tests.test_talker_engine import Sink, cond_input

    monkeypatch.setattr(slow_steps, "_threshold_ms", 0.001)
    ckpt = Checkpoint(tiny_ckpt)
    model = MiniCPMTTS.from_checkpoint(ckpt)
    engine = TalkerEngine(model, max_streams=2)
    sink = Sink()
    greedy = engine.default_sampling(temperature=1.0, greedy=True)
    st = engine.open(engine.make_settings(sampling=greedy, fixed_frames=5), sink)
    engine.chunk(st, cond_input(model, 6, 7))
    with caplog.at_level(logging.WARNING, logger="services.common.slow_steps"):
        engine.run_until_idle()
    lines = [r.getMessage() for r in caplog.records]
    assert any("talker: slow engine step" in m and "prefill" in m and "(streams 1)" in m for m in lines)
    assert any("decode" in m and "(batch 1, steps 1)" in m for m in lines)


def test_scale_multiplies_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """code2wav's timer (scale 5) lets a 2 ms step pass a 1 ms threshold that a plain timer logs."""
    monkeypatch.setattr(slow_steps, "_threshold_ms", 1.0)
    plain, scaled = StepTimer("unit-c"), StepTimer("unit-c", scale=5.0)
    for timer, logged in ((plain, True), (scaled, False)):
        timer.start()
        time.sleep(0.002)
        assert (timer.finish() is not None) is logged


def test_thinker_engine_logs_slow_steps(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The thinker's steps go through the timer: a prefill step names its tokens, a decode step its rows."""
    import torch

    from services.common.checkpoint import Checkpoint
    from services.thinker.engine import EngineConfig, ThinkerEngine
    from services.thinker.runner import build_qwen3_llm
    from services.thinker.sampling import Sampler, SamplingConfig
    from services.thinker.scheduler import WorkItem

    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    llm = build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    seq = engine.open(lambda ev: None)
    engine.submit(seq, WorkItem(list(range(100, 120)), sampler=Sampler(SamplingConfig(max_tokens=3))))
    monkeypatch.setattr(slow_steps, "_threshold_ms", 0.001)
    with caplog.at_level(logging.WARNING, logger="services.common.slow_steps"):
        engine.run_until_idle()
    lines = [r.getMessage() for r in caplog.records if "thinker: slow engine step" in r.getMessage()]
    assert any("forward" in m and "(decode_rows 0, prefill_tokens 20)" in m for m in lines)
    assert any("(decode_rows 1, prefill_tokens 0)" in m and "sample and emit" in m for m in lines)
