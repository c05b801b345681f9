"""Prometheus metrics shared by every stage, labelled by stage name.

Stage-specific metrics (tokens/s, KV bytes, real-time factor...) are declared next to the engine that
updates them; the ones here are the common gauges the gateway, dashboards and the HPA read.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STREAMS_ACTIVE = Gauge("minicpmo_stage_streams_active", "Open Generate streams", ["stage"])
IN_FLIGHT = Gauge(
    "minicpmo_stage_in_flight", "Requests admitted to the engine and not yet finished or dropped", ["stage"]
)
QUEUE_DEPTH = Gauge("minicpmo_stage_queue_depth", "Requests waiting for admission", ["stage"])
REQUESTS = Counter("minicpmo_stage_requests_total", "Generate streams opened", ["stage"])
ERRORS = Counter("minicpmo_stage_errors_total", "Typed errors sent on streams", ["stage", "code"])
INTERRUPTS = Counter("minicpmo_stage_interrupts_total", "Epoch interrupts applied", ["stage"])
STALE_ITEMS = Counter(
    "minicpmo_stage_stale_items_total",
    "Data messages of an older epoch dropped by the epoch fence (services.common.stage_stream)",
    ["stage"],
)
SLOW_STEPS = Counter(
    "minicpmo_stage_slow_steps_total",
    "Engine steps slower than the slow_step_ms setting, each logged with its phases (services.common.slow_steps)",
    ["stage"],
)
BATCH_SIZE = Histogram(
    "minicpmo_stage_batch_size",
    "Rows per engine step",
    ["stage"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
STEP_SECONDS = Histogram(
    "minicpmo_stage_step_seconds",
    "Wall time of one engine step",
    ["stage"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
INTERRUPT_DRAIN = Histogram(
    "minicpmo_stage_interrupt_drain_seconds",
    "Interrupt or cancel received to the end of the last engine step still computing the old epoch "
    "(the stage-side barge-in latency; 0 when nothing of it was running)",
    ["stage"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
DRAINING = Gauge("minicpmo_stage_draining", "1 while the stage drains before shutdown", ["stage"])
DEVICE_MEMORY = Gauge(
    "minicpmo_stage_device_memory_bytes",
    "Device memory of the stage's allocator: allocated (tensors alive), reserved (held by the caching "
    "allocator, what a per-process cap counts), peak_allocated (services.common.memory_watch)",
    ["stage", "kind"],
)
