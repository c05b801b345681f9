"""The thinker engine's Prometheus metrics and the per-step observation (split out of engine.py).

The step metrics are observed one step late, after the next launch (see ``ThinkerEngine.step``); this
module only knows how to turn a step's timings and counts into observations.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import BATCH_SIZE, STEP_SECONDS

STAGE = "thinker"
# Buckets of the thinker's phase histograms (engine step phases, prompt building): 0.5 ms to 2 s.
PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

KV_USED_BYTES = Gauge("minicpmo_thinker_kv_used_bytes", "KV cache bytes allocated to sequences")
KV_BUDGET_BYTES = Gauge("minicpmo_thinker_kv_budget_bytes", "KV cache byte budget")
RUNNING = Gauge("minicpmo_thinker_running", "Sequences admitted and computing")
SESSIONS = Gauge("minicpmo_thinker_sequences", "Sequences holding KV (requests and duplex sessions)")
PREFILL_TOKENS = Counter("minicpmo_thinker_prefill_tokens_total", "Prompt tokens computed")
DECODE_TOKENS = Counter("minicpmo_thinker_decode_tokens_total", "Decode tokens computed")
PREFILL_TPS = Gauge("minicpmo_thinker_prefill_tokens_per_second", "Prefill throughput (EWMA over steps)")
DECODE_TPS = Gauge("minicpmo_thinker_decode_tokens_per_second", "Decode throughput (EWMA over steps)")
STEP_PHASE_SECONDS = Histogram(
    "minicpmo_thinker_step_phase_seconds",
    "Engine step split: 'forward' (the model, CUDA graph or eager; device time from CUDA events on a GPU, "
    "where the launch returns early) and 'sample' (the rest: sampling, its host sync, events)",
    ["phase"],
    buckets=PHASE_BUCKETS,
)
STEP_PATH_SECONDS = Histogram(
    "minicpmo_thinker_step_path_seconds",
    "Engine step forward time by how it ran: 'graph' (decode rows, a CUDA graph replay), 'graph_mixed' "
    "(a replay with prefill chunks packed as rows), 'eager' (the layer loop launched from the host)",
    ["path"],
    buckets=PHASE_BUCKETS,
)
PREFIX_HITS = Counter(
    "minicpmo_thinker_prefix_cache_hit_tokens_total", "Prompt tokens whose KV came from the prefix cache"
)
PREFIX_MISSES = Counter(
    "minicpmo_thinker_prefix_cache_miss_tokens_total",
    "Prompt tokens prefilled (not found in the prefix cache)",
)
PREFIX_EVICTIONS = Counter(
    "minicpmo_thinker_prefix_cache_evictions_total", "Cached KV blocks reclaimed (LRU) for new content"
)
PREFIX_CACHED_BLOCKS = Gauge(
    "minicpmo_thinker_prefix_cache_blocks", "KV blocks registered in the prefix cache (held or evictable)"
)
TTFT = Histogram(
    "minicpmo_thinker_ttft_seconds",
    "Submit to first sampled token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


def observe_step(
    events: tuple | None,
    t_forward: float,
    dt: float,
    n_prefill: int,
    n_decode: int,
    n_chunks: int,
    path: str,
) -> None:
    """One step's split (forward from CUDA events when they are done), token counts, rates, batch size,
    and its forward time under the path it ran (``ModelRunner.last_path``)."""
    if events is not None and events[1].query():
        # Done when sampling synced; a prefill-only step may still run, and waiting here just to time
        # it would stall the next launch, so it keeps its wall-clock split.
        t_forward = min(dt, events[0].elapsed_time(events[1]) / 1000.0)
    STEP_PHASE_SECONDS.labels("forward").observe(t_forward)
    STEP_PATH_SECONDS.labels(path).observe(t_forward)
    STEP_PHASE_SECONDS.labels("sample").observe(dt - t_forward)
    PREFILL_TOKENS.inc(n_prefill)
    DECODE_TOKENS.inc(n_decode)
    if dt > 0:
        if n_prefill:
            PREFILL_TPS.set(_ewma(PREFILL_TPS, n_prefill / dt))
        if n_decode:
            DECODE_TPS.set(_ewma(DECODE_TPS, n_decode / dt))
    STEP_SECONDS.labels(STAGE).observe(dt)
    BATCH_SIZE.labels(STAGE).observe(n_decode + n_chunks)


def _ewma(gauge: Gauge, value: float, alpha: float = 0.2) -> float:
    prev = gauge._value.get()  # prometheus_client keeps the current value here
    return value if prev == 0 else (1 - alpha) * prev + alpha * value
