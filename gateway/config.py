"""Gateway configuration: stage addresses, the deploy profile, and the knobs of the HTTP front."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.deploy_profile import DeployProfile, load_profile
from services.common.tls import ClientTLS


@dataclass
class GatewayConfig:
    stage_addrs: dict[str, str] = field(
        default_factory=lambda: {
            "thinker": "127.0.0.1:50051",
            "talker": "127.0.0.1:50052",
            "code2wav": "127.0.0.1:50053",
        }
    )
    profile: DeployProfile = field(default_factory=lambda: load_profile(None))
    served_model_name: str | None = None  # None: the profile's name (openbmb/MiniCPM-o-4_5)
    api_key: str | None = None
    allowed_media_root: Path | None = None
    http_fetch: bool = False
    max_concurrent_requests: int | None = None  # None: from the profile
    max_realtime_sessions: int | None = None  # None: from the profile
    max_body_bytes: int | None = None  # None: from the profile
    request_timeout_s: float | None = None  # None: from the profile
    body_idle_timeout_s: float | None = None  # None: from the profile (gateway.body_idle_timeout_s, 30 s)
    drain_grace_s: float | None = None  # None: from the profile (gateway.drain_grace_s, 30 s)
    stage_tls: ClientTLS | None = None  # None: the profile's tls section, if any (else plaintext)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.profile.served_model_name

    @property
    def concurrency_limit(self) -> int:
        return self.max_concurrent_requests or self.profile.gateway.max_concurrent_requests

    @property
    def realtime_session_limit(self) -> int:
        return self.max_realtime_sessions or self.profile.gateway.max_realtime_sessions

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes or self.profile.gateway.max_body_bytes

    @property
    def tls(self) -> ClientTLS | None:
        """TLS towards the stages: the explicit setting, else the deploy profile's ``tls`` section."""
        if self.stage_tls is not None:
            return self.stage_tls
        t = self.profile.tls
        return ClientTLS(t.ca_file, t.client_cert_file, t.client_key_file) if t is not None else None

    @property
    def drain_grace(self) -> float:
        """Seconds in-flight work may run on after SIGTERM before it is ended (gateway.shutdown)."""
        return self.drain_grace_s if self.drain_grace_s is not None else self.profile.gateway.drain_grace_s

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_s or self.profile.gateway.request_timeout_s

    @property
    def body_idle_timeout(self) -> float:
        """Seconds a request body may send nothing before it is answered 408 (gateway.body_idle_timeout_s)."""
        return self.body_idle_timeout_s or self.profile.gateway.body_idle_timeout_s
