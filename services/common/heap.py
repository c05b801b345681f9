"""Keep the start-up heap out of the garbage collector's full passes.

Why: a stage process holds ~470k tracked Python objects once its model, kernels and graphs are built
(transformers modules, imported libraries); a full (generation 2) collection walks all of them, ~220 ms
on the CI box's CPU, and runs on whichever thread allocated last, holding the GIL: the engine thread
stalls and every stream of a burst waits at once. Those objects live as long as the process, so after
start-up they are moved to the permanent generation (``gc.freeze``) and later collections only walk what
serving allocates. Servers call :func:`freeze_startup_heap` once, after their warm-up and before they
take traffic.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object; returns how many are frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the GC (%.0f ms)", frozen, 1e3 * (time.perf_counter() - t0))
    return frozen
