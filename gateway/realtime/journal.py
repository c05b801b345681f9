"""Replay journal (docs/protocol.md, Realtime session end): numbered outbound events kept until acked, for
session.resume.

Every journaled event gets the next ``server_event_seq``. Entries leave the journal when the client acks
them (``session.event_ack``) or when they are older than the TTL. If the journal would exceed its byte
budget it stops journaling: later events go out without a seq, and a resume asks for a resync.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from gateway.realtime.errors import RealtimeError
from gateway.realtime.events import encode_event


@dataclass
class JournalEntry:
    seq: int
    event: dict[str, Any]
    size: int
    created: float


class ReplayPlan:
    """Outcome of a resume request: the events to replay, or the reason a resync is required."""

    def __init__(self, events: list[dict[str, Any]], resync_reason: str | None) -> None:
        self.events = events
        self.resync_reason = resync_reason


class EventJournal:
    def __init__(self, *, ttl_s: float = 60.0, max_bytes: int = 8 * 1024 * 1024) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.head = 0  # last seq assigned
        self.overflowed = False
        self._entries: deque[JournalEntry] = deque()
        self._bytes = 0
        self._acked = 0
        # Lowest seq that can no longer be replayed because it expired (not because it was acked).
        self._expired_through = 0

    def record(self, event: dict[str, Any]) -> dict[str, Any]:
        """Stamp ``server_event_seq`` on the event and keep it; after overflow, pass it through unstamped."""
        self._expire()
        if self.overflowed:
            return event
        encoded = len(encode_event(event))
        if self._bytes + encoded > self.max_bytes:
            self.overflowed = True
            return event
        self.head += 1
        event["server_event_seq"] = self.head
        self._entries.append(JournalEntry(self.head, event, encoded, time.monotonic()))
        self._bytes += encoded
        return event

    def ack(self, seq: object) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0 or seq > self.head:
            raise RealtimeError(
                "invalid_event_ack",
                f"server_event_seq must be an integer in [0, {self.head}]",
                param="server_event_seq",
            )
        self._acked = max(self._acked, seq)
        while self._entries and self._entries[0].seq <= seq:
            self._bytes -= self._entries.popleft().size

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._entries and self._entries[0].created < cutoff:
            entry = self._entries.popleft()
            self._bytes -= entry.size
            self._expired_through = entry.seq

    def plan_replay(self, last_received: int) -> ReplayPlan:
        """Events with seq > ``last_received``; a gap (expired or acked-away events) needs a resync."""
        self._expire()
        if self.overflowed:
            return ReplayPlan([], "journal_overflow")
        first_needed = last_received + 1
        oldest_kept = self._entries[0].seq if self._entries else self.head + 1
        if first_needed < oldest_kept and first_needed <= self.head:
            # The client wants events that were acked or expired: replay cannot bridge them.
            if first_needed <= max(self._expired_through, self._acked):
                return ReplayPlan([], "journal_gap")
        return ReplayPlan([e.event for e in self._entries if e.seq > last_received], None)
