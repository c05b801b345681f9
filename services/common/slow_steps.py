"""A log line for every engine step that took too long, with where its time went.

Why: a stall of one batched step stalls every stream in it at once, and the step histograms only say
that some steps were slow, not which phase (commands, prefills, decode) or what shapes they ran. A
step over the threshold logs its phases and their facts (batch sizes, rows) once, and counts in
``minicpmo_stage_slow_steps_total``. Threshold: the stage's ``slow_step_ms`` profile key
(``--slow-step-ms`` of every stage CLI; default 50 ms, 0 turns the log off), set once per process by
:func:`configure`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from services.common.metrics import SLOW_STEPS

log = logging.getLogger(__name__)
DEFAULT_MS = 50.0
_threshold_ms = DEFAULT_MS


def configure(ms: float) -> None:
    """Set this process's slow-step threshold in ms (0: off); timers without their own limit use it."""
    global _threshold_ms
    if not ms >= 0:
        raise ValueError(f"slow_step_ms must be >= 0 (got {ms!r})")
    _threshold_ms = float(ms)


def threshold_ms() -> float:
    """The process's slow-step threshold (ms); 0: off."""
    return _threshold_ms


class StepTimer:
    """Phases of one engine step: ``start()``, ``mark(phase, **facts)`` after each, ``finish()``.

    A fact may be a zero-argument callable: it is called only when the step is logged, so a fact that
    costs something to read (a CUDA event's elapsed time) costs nothing on the steps that are not slow.
    """

    def __init__(self, stage: str, limit_ms: float | None = None, scale: float = 1.0) -> None:
        self.stage = stage
        self._limit_ms = limit_ms  # None: the process's threshold (configure), read at each finish
        # A stage whose normal step is long (code2wav's batch of windows) is slow at a multiple of it.
        self._scale = scale
        self._counter = SLOW_STEPS.labels(stage)
        self._t0 = self._last = 0.0
        self._phases: list[tuple[str, float, dict[str, Any]]] = []

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._phases.clear()

    def mark(self, phase: str, **facts: Any) -> None:
        now = time.perf_counter()
        self._phases.append((phase, 1e3 * (now - self._last), facts))
        self._last = now

    def finish(self) -> float | None:
        """Ends the step; logs and counts it when slower than the threshold. Returns its ms if it was."""
        total = 1e3 * (time.perf_counter() - self._t0)
        limit = self._scale * (threshold_ms() if self._limit_ms is None else self._limit_ms)
        if limit <= 0 or total < limit:
            return None
        self._counter.inc()
        parts = []
        for phase, ms, facts in self._phases:
            detail = ", ".join(f"{k} {v() if callable(v) else v}" for k, v in facts.items())
            parts.append(f"{phase} {ms:.1f} ms" + (f" ({detail})" if detail else ""))
        log.warning("%s: slow engine step, %.1f ms: %s", self.stage, total, "; ".join(parts))
        return total
