"""Server-VAD turn taking for one session (``turn_detection: {"type": "server_vad"}``, docs/protocol.md,
Realtime interrupts).

The session routes every appended sample through here instead of straight into the input buffer:

* while nobody speaks, audio is kept only as a short pre-roll (enough for ``prefix_padding_ms`` and the
  minimum speech run), so silence never reaches the model and never fills the input buffer;
* on a detected speech start the pre-roll from the padded start point enters the input buffer,
  ``input_audio_buffer.speech_started{audio_start_ms, item_id}`` is sent and, if a response is running,
  it is hard-interrupted with reason ``turn_detected`` after an
  ``overlap.decision{action:"barge_in", reason:"server_vad_speech_started"}``;
* on a detected speech stop, ``input_audio_buffer.speech_stopped{audio_end_ms, item_id}`` is sent and the
  buffer is committed as that item and answered, exactly like ``input_audio_buffer.commit`` followed by
  ``response.create`` in the turn lane. ``create_response`` is accepted but ignored (the protocol says so):
  a detected turn is always answered.

The detector itself (gateway/realtime/vad.py: Silero VAD, or the energy fallback the session names) works
in audio time, so the outcome depends only on the
audio, never on how the client sized or paced its appends.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from gateway.realtime import events as ev
from gateway.realtime.errors import RealtimeError
from gateway.realtime.host import SessionCore
from gateway.realtime.lifecycle import ResponseLifecycle
from gateway.realtime.vad import SpeechStarted, SpeechStopped, make_detector


class VadHost(SessionCore, Protocol):
    """What server VAD uses of its session (see ``gateway.realtime.host``)."""

    lifecycle: ResponseLifecycle

    @property
    def server_vad(self) -> ServerVadTurns | None: ...


class ServerVadTurns:
    def __init__(
        self,
        s: VadHost,
        params: dict[str, Any],
        *,
        clock: int,
        in_speech: bool = False,
        item_id: str | None = None,
    ) -> None:
        self.s = s
        self.params = dict(params)
        self.detector = make_detector(self.params, clock=clock, speaking=in_speech)
        self.in_speech = in_speech
        self.item_id = item_id  # the user item the current speech will become (announced in speech_started)
        self._preroll: list[np.ndarray] = []
        self._preroll_start = clock  # absolute sample index of the first pre-roll sample
        self._preroll_size = 0
        self._frames: list[bytes] = []  # video frames waiting for the next audio that enters the buffer

    def reset(self) -> None:
        """The client cleared or committed the input: forget the pre-roll and any speech in progress."""
        self.detector.reset()
        self.in_speech = False
        self.item_id = None
        self._frames = []
        self._drop_preroll(self.detector.clock)

    def push(self, samples: np.ndarray, frames: list[bytes]) -> None:
        """Route one append (16 kHz float) through the detector; act on every boundary inside it."""
        s = self.s
        if s.cfg.auto_response:
            self._observe(samples)
            return
        if frames:
            self._frames = frames
        overlapped = s.lifecycle.active
        barged = False
        chunk_start = self.detector.clock
        pos = chunk_start
        for event in self.detector.process(samples):
            self._route(samples[pos - chunk_start : event.at_sample - chunk_start])
            pos = event.at_sample
            if isinstance(event, SpeechStarted):
                barged = self._speech_started(event) or barged
            elif isinstance(event, SpeechStopped):
                self._speech_stopped(event)
        self._route(samples[pos - chunk_start :])
        if overlapped is not None and not barged and s.lifecycle.active is overlapped:
            # One decision per overlapping append (docs/protocol.md, Realtime interrupts): no speech start in
            # it means nothing to act on.
            action, reason = (
                ("listen", "accumulating_overlap_speech") if self.in_speech else ("drop", "silence_or_noise")
            )
            self._decision(action, reason, overlapped.id)

    def _observe(self, samples: np.ndarray) -> None:
        """Native lane: the audio goes to the model unit by unit as always (the model owns when to speak);
        the detector only marks the user's turns. A speech start announces the item and, with a response
        running, barges in (``barge_in_on_speech``); a speech stop seals the item without asking for a
        response. Items end on the append that carried the stop (the caller pushes that append after)."""
        s = self.s
        for event in self.detector.process(samples):
            if isinstance(event, SpeechStarted):
                self.in_speech = True
                self.item_id = ev.new_user_item_id()
                start_ms = event.start_sample * 1000 // 16_000
                s.emit("input_audio_buffer.speech_started", audio_start_ms=start_ms, item_id=self.item_id)
                active = s.lifecycle.active
                if active is not None and s.cfg.overlap_policy == "barge_in_on_speech":
                    if s.settings.supports_barge_in:
                        self._decision("barge_in", "server_vad_speech_started", active.id)
                        s.interrupt("turn_detected")
                    else:
                        self._decision("listen", "barge_in_unsupported", active.id)
            elif isinstance(event, SpeechStopped):
                self.in_speech = False
                item_id, self.item_id = self.item_id, None
                s.emit("input_audio_buffer.speech_stopped", audio_end_ms=event.audio_end_ms, item_id=item_id)
                if s.input.has_audio:
                    s.seal_input(create=False, speech=True, item_id=item_id)

    # ---------------------------------------------------------------- routing

    def _route(self, segment: np.ndarray) -> None:
        if segment.size == 0:
            return
        if self.in_speech:
            self._feed(segment)
            return
        self._preroll.append(segment)
        self._preroll_size += segment.size
        excess = self._preroll_size - self.detector.history_samples
        while excess > 0 and self._preroll:
            head = self._preroll[0]
            if head.size <= excess:
                self._preroll.pop(0)
                cut = head.size
            else:
                self._preroll[0] = head[excess:]
                cut = excess
            self._preroll_start += cut
            self._preroll_size -= cut
            excess -= cut

    def _feed(self, segment: np.ndarray) -> None:
        """Speech audio enters the input buffer (the uncommitted user item)."""
        s = self.s
        if segment.size == 0:
            return
        frames, self._frames = self._frames, []
        s.input.push_speech(segment, frames)

    def _drop_preroll(self, next_start: int) -> None:
        self._preroll, self._preroll_size, self._preroll_start = [], 0, next_start

    # ---------------------------------------------------------------- boundaries

    def _speech_started(self, event: SpeechStarted) -> bool:
        s = self.s
        start = max(event.start_sample, self._preroll_start)
        pre = np.concatenate(self._preroll) if self._preroll else np.zeros(0, dtype=np.float32)
        padded = pre[start - self._preroll_start :]
        self._drop_preroll(event.at_sample)
        self.in_speech = True
        self.item_id = ev.new_user_item_id()
        s.emit(
            "input_audio_buffer.speech_started", audio_start_ms=start * 1000 // 16_000, item_id=self.item_id
        )
        barged = False
        active = s.lifecycle.active
        if active is not None:
            if s.settings.supports_barge_in:
                self._decision("barge_in", "server_vad_speech_started", active.id)
                s.interrupt("turn_detected")
                barged = True
            else:
                self._decision("listen", "barge_in_unsupported", active.id)
        self._feed(padded)
        return barged

    def _speech_stopped(self, event: SpeechStopped) -> None:
        s = self.s
        self.in_speech = False
        item_id, self.item_id = self.item_id, None
        self._drop_preroll(event.end_sample)
        s.emit("input_audio_buffer.speech_stopped", audio_end_ms=event.audio_end_ms, item_id=item_id)
        if not s.input.has_audio:
            return
        if s.pending_commits() >= s.settings.max_pending_commits:
            s.emit_error(
                RealtimeError(
                    "input_backpressure", f"more than {s.settings.max_pending_commits} pending commits"
                )
            )
            s.input.clear()
            return
        s.seal_input(create=True, speech=True, item_id=item_id)

    def _decision(self, action: str, reason: str, response_id: str) -> None:
        s = self.s
        s.emit(
            "overlap.decision",
            session_id=s.id,
            epoch=s.epoch,
            policy=s.cfg.overlap_policy,
            action=action,
            reason=reason,
            metadata={"response_id": response_id},
        )


def sync_server_vad(s: VadHost) -> ServerVadTurns | None:
    """The session's server-VAD state after a (re)configuration: kept, rebuilt with new knobs, or dropped.

    A knob change keeps the speech in progress (same item, same buffered audio); switching to ``null``
    leaves any buffered speech in the input buffer for the client to commit or clear.
    """
    params = s.cfg.turn_detection
    current = s.server_vad
    if params is None:
        return None
    if current is not None and current.params == params:
        return current
    if current is None:
        return ServerVadTurns(s, params, clock=s.input.clock)
    return ServerVadTurns(
        s, params, clock=current.detector.clock, in_speech=current.in_speech, item_id=current.item_id
    )
