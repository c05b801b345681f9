"""A log line for every engine step that took too long, with where its time went.

Why: a stall of one batched step stalls every stream in it at once, and the step histograms only say
that some steps were slow, not which phase (commands, prefills, decode) or what shapes they ran. A
step over the threshold logs its phases and their facts (batch sizes, rows) once, and counts in
``minicpmo_stage_slow_steps_total``. Threshold: ``MINICPMO_SLOW_STEP_MS`` (default 50 ms; 0 turns the
log off).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from services.common.metrics import SLOW_STEPS

log = logging.getLogger(__name__)
ENV = "MINICPMO_SLOW_STEP_MS"
DEFAULT_MS = 50.0


def threshold_ms() -> float:
    """The slow-step threshold from the environment (ms); 0 or less: off."""
    raw = os.environ.get(ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_MS
    except ValueError as exc:
        raise ValueError(f"{ENV} must be a number of milliseconds (got {raw!r})") from exc


class StepTimer:
    """Phases of one engine step: ``start()``, ``mark(phase, **facts)`` after each, ``finish()``."""

    def __init__(self, stage: str, limit_ms: float | None = None) -> None:
        self.stage = stage
        self.limit_ms = threshold_ms() if limit_ms is None else limit_ms
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
        if self.limit_ms <= 0 or total < self.limit_ms:
            return None
        self._counter.inc()
        parts = []
        for phase, ms, facts in self._phases:
            detail = ", ".join(f"{k} {v}" for k, v in facts.items())
            parts.append(f"{phase} {ms:.1f} ms" + (f" ({detail})" if detail else ""))
        log.warning("%s: slow engine step, %.1f ms: %s", self.stage, total, "; ".join(parts))
        return total
