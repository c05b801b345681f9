"""Session admission and lookup: the max-sessions slot limit and resume-token checks (docs/protocol.md,
Realtime session end)."""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict

from gateway.logs import bind_request_id
from gateway.realtime import metrics
from gateway.realtime.attachment import hash_token
from gateway.realtime.config import SessionConfig
from gateway.realtime.errors import RealtimeError
from gateway.realtime.pipeline.events import PipelineFactory
from gateway.realtime.session import DuplexSession
from gateway.realtime.settings import RealtimeSettings

log = logging.getLogger(__name__)

_TOMBSTONE_LIMIT = 4096


class SessionRegistry:
    def __init__(self, settings: RealtimeSettings, pipeline_factory: PipelineFactory) -> None:
        self.settings = settings
        self.pipeline_factory = pipeline_factory
        self.sessions: dict[str, DuplexSession] = {}
        self.draining = False  # set by the gateway's drain (gateway.shutdown): no new sessions, resumes only
        # Ended sessions, so a late resume gets session_resume_expired rather than "unknown".
        self._ended: OrderedDict[str, float] = OrderedDict()

    def open(self, cfg: SessionConfig) -> DuplexSession:
        if self.draining:
            metrics.SESSIONS_REJECTED.labels("shutting_down").inc()
            raise RealtimeError(
                "resource_exhausted",
                "server_shutting_down: the server is draining; open a session on another replica or retry",
                retryable=True,
            )
        if len(self.sessions) >= self.settings.max_sessions and not self._reclaim_one():
            metrics.SESSIONS_REJECTED.labels("resource_exhausted").inc()
            raise RealtimeError(
                "resource_exhausted",
                f"duplex_session_capacity_exhausted: limit={self.settings.max_sessions}",
                retryable=True,
            )
        session = DuplexSession(self.settings, cfg, self.pipeline_factory, self._finished)
        # From here on the socket handler's log lines, and those of the session task and its pipeline
        # tasks (they copy this context when created), carry the session id as their request id.
        bind_request_id(session.id)
        self.sessions[session.id] = session
        metrics.SESSIONS.set(len(self.sessions))
        session.start()
        return session

    def _reclaim_one(self) -> bool:
        """Free the slot of the session detached longest, if any waits for a resume
        (:meth:`DuplexSession.reclaim`): a live client goes before one that may never come back."""
        waiting = sorted(
            (s for s in self.sessions.values() if s.detached_at is not None),
            key=lambda s: s.detached_at or 0.0,
        )
        for session in waiting:
            if session.reclaim():
                log.info("realtime session %s: detached, its slot reclaimed for a new session", session.id)
                metrics.SESSIONS_RECLAIMED.inc()
                self._finished(session)
                return True
        return False

    def _finished(self, session: DuplexSession) -> None:
        self.sessions.pop(session.id, None)
        metrics.SESSIONS.set(len(self.sessions))
        self._ended[session.id] = time.monotonic()
        while len(self._ended) > _TOMBSTONE_LIMIT:
            self._ended.popitem(last=False)

    def lookup_for_resume(self, event: dict[str, object]) -> tuple[DuplexSession, int]:
        if not self.settings.supports_session_resume:
            raise RealtimeError("unsupported_session_resume", "this deployment does not resume sessions")
        session_id = event.get("session_id")
        token = event.get("resume_token")
        last = event.get("last_received_server_event_seq", 0)
        if not isinstance(session_id, str) or not isinstance(token, str):
            raise RealtimeError("invalid_session_resume", "session_id and resume_token are required")
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise RealtimeError(
                "invalid_session_resume",
                "last_received_server_event_seq must be an integer >= 0",
                param="last_received_server_event_seq",
            )
        session = self.sessions.get(session_id)
        if session is None or session.state != "open":
            if session_id in self._ended or session is not None:
                raise RealtimeError("session_resume_expired", f"session {session_id} has ended")
            raise RealtimeError("invalid_session_resume", f"unknown session {session_id}")
        if session.resume_token_hash is None or not hmac.compare_digest(
            session.resume_token_hash, hash_token(token)
        ):
            raise RealtimeError("invalid_resume_token", "resume_token does not match")
        bind_request_id(session.id)
        if last > session.journal.head:
            raise RealtimeError(
                "invalid_session_resume",
                "last_received_server_event_seq is ahead of the server",
                param="last_received_server_event_seq",
            )
        return session, last
