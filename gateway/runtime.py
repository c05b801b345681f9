"""What every route shares at run time: config, stage connections, the pipeline and admission control.

Stored on ``app.state.runtime``. Other routers (the realtime WebSocket) reach the stages through
``runtime.stages`` (a :class:`gateway.stage_clients.StageSet`) and share the same admission counter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.auth import check_api_key
from gateway.config import GatewayConfig
from gateway.media import MediaPolicy
from gateway.metrics import IN_FLIGHT, REJECTED
from gateway.openai.errors import APIError
from gateway.pipeline import ChatPipeline
from gateway.stage_clients import StageSet, StageTimeouts
from gateway.stage_health import StageMonitor


@dataclass
class GatewayRuntime:
    config: GatewayConfig
    stages: StageSet
    pipeline: ChatPipeline
    media_policy: MediaPolicy
    created: int
    monitor: StageMonitor
    in_flight: int = 0
    draining: bool = False  # set on SIGTERM (gateway.shutdown): new requests are refused with 503
    stage_info: dict[str, object] = field(default_factory=dict)

    @classmethod
    def build(cls, config: GatewayConfig, created: int) -> GatewayRuntime:
        stages = StageSet(config.stage_addrs, StageTimeouts(stream_s=config.timeout_s), config.tls)
        policy = MediaPolicy(
            limits=config.profile.gateway.media,
            allowed_root=config.allowed_media_root,
            http_fetch=config.http_fetch,
        )
        return cls(
            config=config,
            stages=stages,
            pipeline=ChatPipeline(stages),
            media_policy=policy,
            created=created,
            monitor=StageMonitor(stages),
        )

    def check_api_key(self, authorization: str | None) -> bool:
        """True when no API key is configured or ``authorization`` is ``Bearer <key>`` (for WebSocket routes)."""
        return check_api_key(self.config, authorization)

    def acquire(self) -> None:
        """Take one concurrency slot; 429 when none is free, 503 while shutting down. Pair with :meth:`release`."""
        if self.draining:
            REJECTED.labels("shutting_down").inc()
            raise APIError(
                503, "the server is shutting down; retry shortly", None, headers={"Retry-After": "3"}
            )
        if self.in_flight >= self.config.concurrency_limit:
            REJECTED.labels("concurrency").inc()
            raise APIError(
                429,
                f"server is at its limit of {self.config.concurrency_limit} concurrent requests; retry shortly",
                None,
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        IN_FLIGHT.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        IN_FLIGHT.set(self.in_flight)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one concurrency slot for the duration of a block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()
