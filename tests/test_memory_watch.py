"""services.common.memory_watch: allocator gauges every check, a log line per new high-water step (with the
CUDA counters replaced by a scripted allocator, since CI has no GPU), nothing at all on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from services.common import memory_watch
from services.common.memory_watch import MemoryWatch

GIB = 1 << 30


def _gauge(kind: str) -> float | None:
    return REGISTRY.get_sample_value("minicpmo_stage_device_memory_bytes", {"stage": "probe", "kind": kind})


def test_high_water_lines_and_gauges(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"allocated": 1 * GIB, "peak": 1 * GIB, "reserved": 2 * GIB}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    watch = MemoryWatch("probe", torch.device("cuda", 0), log_step_bytes=GIB // 2, interval_s=0.0)
    caplog.set_level(logging.INFO, logger=memory_watch.__name__)
    watch.check()  # nothing new since the watch started
    state.update(peak=GIB + GIB // 4, allocated=GIB + GIB // 4)
    watch.check()  # a quarter GiB higher: below the step
    assert not caplog.records
    assert _gauge("allocated") == GIB + GIB // 4 and _gauge("reserved") == 2 * GIB
    state.update(peak=3 * GIB, allocated=GIB // 2, reserved=4 * GIB)
    watch.check()
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "probe: device memory high-water 3.00 GiB allocated (now 0.50 GiB, allocator holds 4.00 GiB)"
    )
    assert _gauge("peak_allocated") == 3 * GIB and _gauge("allocated") == GIB // 2
    watch.check()  # the same peak again: no second line
    assert len(caplog.records) == 1


def test_counters_are_read_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine steps call check() hundreds of times a second; the counters are read once per interval, and
    a peak reached between reads is still seen (the allocator keeps the running maximum)."""
    reads: list[str] = []
    peak = {"bytes": 1 * GIB}

    def counter(name: str, value: dict[str, int]):  # noqa: ANN202
        def read(device: object = None) -> int:
            reads.append(name)
            return value["bytes"]

        return read

    monkeypatch.setattr(torch.cuda, "memory_allocated", counter("allocated", peak))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter("peak", peak))
    monkeypatch.setattr(torch.cuda, "memory_reserved", counter("reserved", peak))
    now = {"t": 100.0}
    watch = MemoryWatch("probe", torch.device("cuda", 0), interval_s=0.5, clock=lambda: now["t"])
    reads.clear()  # the start-up read of the peak
    for _ in range(50):  # one burst of steps: one read
        watch.check()
        now["t"] += 0.001
    assert reads == ["peak", "allocated", "reserved"]
    peak["bytes"] = 5 * GIB  # reached between reads
    now["t"] += 0.5
    watch.check()
    assert len(reads) == 6 and _gauge("peak_allocated") == 5 * GIB


def test_cpu_watch_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(device: object = None) -> int:
        raise AssertionError("a CPU stage must not touch the CUDA counters")

    monkeypatch.setattr(torch.cuda, "memory_allocated", boom)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", boom)
    MemoryWatch("cpu-probe", torch.device("cpu")).check()
