"""Gateway Prometheus metrics (served on ``GET /metrics``).

Latency histograms use buckets from 10 ms to 2 min because the same code serves a CPU demo (seconds)
and a GPU deployment (tens of milliseconds).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.2,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    60.0,
    120.0,
)

REQUESTS = Counter(
    "minicpmo_gateway_requests_total", "HTTP requests answered, by route and status", ["route", "status"]
)
IN_FLIGHT = Gauge("minicpmo_gateway_requests_in_flight", "Chat requests being served now")
REJECTED = Counter("minicpmo_gateway_rejected_total", "Requests refused before reaching a stage", ["reason"])
TTFT = Histogram(
    "minicpmo_gateway_time_to_first_token_seconds",
    "Request start to first text delta",
    buckets=_LATENCY_BUCKETS,
)
TTFA = Histogram(
    "minicpmo_gateway_time_to_first_audio_seconds",
    "Request start to first audio chunk",
    buckets=_LATENCY_BUCKETS,
)
E2E = Histogram("minicpmo_gateway_request_seconds", "Request start to last byte", buckets=_LATENCY_BUCKETS)
RTF = Histogram(
    "minicpmo_gateway_real_time_factor",
    "Wall time from the first speech chunk to the last audio chunk divided by the audio duration",
    buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0),
)
AUDIO_SECONDS = Counter("minicpmo_gateway_audio_seconds_total", "Seconds of speech sent to clients")
STAGE_ERRORS = Counter(
    "minicpmo_gateway_stage_errors_total", "Failures attributed to a stage, by stable code", ["stage", "code"]
)
STAGE_RETRIES = Counter(
    "minicpmo_gateway_stage_retries_total",
    "Stage streams re-opened after failing as UNAVAILABLE before their first response (one retry at most)",
    ["stage"],
)
CLIENT_DISCONNECTS = Counter("minicpmo_gateway_client_disconnects_total", "Requests abandoned by the client")
STAGE_UP = Gauge(
    "minicpmo_gateway_stage_up",
    "1 while the gateway's health probe finds the stage serving (any replica), 0 while it is down",
    ["stage"],
)
REPLICA_UP = Gauge(
    "minicpmo_gateway_stage_replica_up",
    "1 while the gateway's health probe finds this replica of the stage serving, 0 while it is down",
    ["stage", "replica"],
)
