"""Keep the start-up heap out of the garbage collector's full passes, and time every collection.

Why: a stage process holds ~470k tracked Python objects once its model, kernels and graphs are built
(transformers modules, imported libraries); a full (generation 2) collection walks all of them, ~220 ms
on the CI box's CPU, and runs on whichever thread allocated last, holding the GIL: the engine thread
stalls and every stream of a burst waits at once. Those objects live as long as the process, so after
start-up they are moved to the permanent generation (``gc.freeze``) and later collections only walk what
serving allocates. ``minicpmo_gc_pause_seconds`` (per generation) shows what collections still cost.

Servers call :func:`prepare_heap_for_serving` once, after their warm-up and before they take traffic;
``freeze=False`` leaves the heap unfrozen (the pauses are still timed), for A/B runs.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from prometheus_client import Histogram

log = logging.getLogger(__name__)

GC_PAUSE = Histogram(
    "minicpmo_gc_pause_seconds",
    "Wall time of one Python garbage collection in this process (the GIL is held throughout)",
    ["generation"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
# Resolved once: the callback runs on every collection (generation 0 several times a second while
# serving), where a labels() lookup would cost as much as the observation.
_PAUSE_BY_GENERATION = {g: GC_PAUSE.labels(str(g)) for g in range(3)}
_started: list[float] = []


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        child = _PAUSE_BY_GENERATION.get(info.get("generation", 2)) or _PAUSE_BY_GENERATION[2]
        child.observe(time.perf_counter() - _started.pop())


def watch_gc_pauses() -> None:
    """Time every collection into ``minicpmo_gc_pause_seconds`` (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object; returns how many are frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the GC (%.0f ms)", frozen, 1e3 * (time.perf_counter() - t0))
    return frozen


def prepare_heap_for_serving(freeze: bool = True) -> int:
    """Time collections from now on and freeze the start-up heap (unless ``freeze`` is False); returns
    the frozen object count (0 when not frozen)."""
    watch_gc_pauses()
    if not freeze:
        log.info("the start-up heap stays in the GC's full passes")
        return 0
    return freeze_startup_heap()
