"""Prometheus metrics of the realtime endpoint (exported by the gateway's ``GET /metrics``).

Barge-in latency is measured at the gateway from the interrupt command's arrival to the cancelled
``response.done`` (after which no audio of that response is sent), and per stage from the moment the
interrupt is queued for a stage stream to that stage's ``InterruptAck``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

SESSIONS = Gauge("minicpmo_realtime_sessions", "Admitted realtime duplex sessions (attached or in grace)")
SESSIONS_REJECTED = Counter("minicpmo_realtime_sessions_rejected_total", "Session opens refused", ["code"])
SESSIONS_RECLAIMED = Counter(
    "minicpmo_realtime_sessions_reclaimed_total",
    "Detached sessions (waiting for a resume) ended early to admit a new session",
)
ERRORS = Counter("minicpmo_realtime_errors_total", "error events sent to realtime clients", ["code"])
RESPONSES = Counter("minicpmo_realtime_responses_total", "Finished responses by status", ["status"])
AUDIO_SECONDS = Counter("minicpmo_realtime_audio_seconds_total", "Seconds of assistant audio sent")
UNITS = Counter("minicpmo_realtime_units_total", "1 s input units sent to the thinker")
BARGE_IN_GATEWAY = Histogram(
    "minicpmo_realtime_barge_in_seconds",
    "Hard interrupt received to the cancelled response.done (no audio of it is sent afterwards)",
    buckets=_FAST_BUCKETS,
)
BARGE_IN_STAGE = Histogram(
    "minicpmo_realtime_stage_interrupt_ack_seconds",
    "Interrupt queued for a stage stream to that stage's InterruptAck",
    ["stage"],
    buckets=_FAST_BUCKETS,
)
FIRST_AUDIO_PHASE = Histogram(
    "minicpmo_realtime_first_audio_phase_seconds",
    "Turn lane: a response's request (its committed units handed to the thinker stream) to 'decision' (the "
    "requesting unit decided), 'speech' (its first speech chunk), 'window' (the talker's first codec "
    "window) and 'audio' (code2wav's first audio), all at the gateway",
    ["phase"],
    buckets=_FAST_BUCKETS,
)
UNIT_DECISION = Histogram(
    "minicpmo_realtime_unit_decision_seconds",
    "1 s unit sent to the thinker to its listen/speak decision arriving at the gateway",
    buckets=_FAST_BUCKETS,
)
