"""The device memory a stage's allocator holds, as gauges and a log line per new high-water mark.

Why: a stage runs under a per-process memory cap, and what it allocates beyond its sized pools
(activations, per-session caches, graph pools) decides how many streams fit under it. Out of memory
in the middle of serving says only that the cap was reached; the high-water lines say how the use
grew with the load up to it, so the pools and headroom can be sized from a run's log.
``minicpmo_stage_device_memory_bytes{kind}`` carries ``allocated`` (tensors alive), ``reserved`` (what
the caching allocator holds, what the cap counts) and ``peak_allocated``.

The counters are read at most once per ``interval_s`` (default 0.5 s), not on every engine step. Each
read builds the allocator's whole statistics dict in Python (``torch.cuda.memory_stats``): the three
reads took 231 us on an H100, and on every step they cost the talker's batch-1 decode 10% of its frames
per second (916 against 1021, BENCHMARKS.md). The peak is the allocator's own running maximum, so a
throttled read still sees every high-water mark, only later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.common.metrics import DEVICE_MEMORY

log = logging.getLogger(__name__)

LOG_STEP_BYTES = 256 << 20  # a new high-water line each time the peak passes the last one by this much
INTERVAL_S = 0.5  # the counters are read at most this often


class MemoryWatch:
    """Call :meth:`check` once per engine iteration: on CUDA it reads the counters when ``interval_s`` has
    passed since its last read (``clock`` is ``time.monotonic``; tests pass their own), on CPU never."""

    def __init__(
        self,
        stage: str,
        device: torch.device,
        log_step_bytes: int = LOG_STEP_BYTES,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage = stage
        self.device = device
        self.log_step_bytes = log_step_bytes
        self.interval_s = interval_s
        self._clock = clock
        self._next_read = 0.0
        self.logged_peak = 0
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self.logged_peak = torch.cuda.max_memory_allocated(device)
        # Labelled children resolved once: check() runs on every engine step.
        self._allocated = DEVICE_MEMORY.labels(stage, "allocated")
        self._reserved = DEVICE_MEMORY.labels(stage, "reserved")
        self._peak = DEVICE_MEMORY.labels(stage, "peak_allocated")

    def check(self) -> None:
        if not self.on_cuda:
            return
        now = self._clock()
        if now < self._next_read:
            return
        self._next_read = now + self.interval_s
        peak = torch.cuda.max_memory_allocated(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self._allocated.set(allocated)
        self._reserved.set(reserved)
        self._peak.set(peak)
        if peak >= self.logged_peak + self.log_step_bytes:
            self.logged_peak = peak
            log.info(
                "%s: device memory high-water %.2f GiB allocated (now %.2f GiB, allocator holds %.2f GiB)",
                self.stage,
                peak / 2**30,
                allocated / 2**30,
                reserved / 2**30,
            )
