"""Response lifecycle projection (docs/protocol.md, Realtime events): pipeline outputs → normative event
order.

Owns the active response of a session. Every event of a response is emitted here, in the order

    response.created → conversation.item.added → conversation.item.created → response.output_item.added
    → response.content_part.added → [response.speak] → (output_audio.delta → transcript.delta)*
    → output_audio.done → [transcript.done] → content_part.done → output_item.done
    → conversation.item.done → response.done → rate_limits.updated

A function call the model makes is an output item of its own (conversation.item.added →
response.output_item.added → function_call_arguments.delta* → function_call_arguments.done →
response.output_item.done → conversation.item.done), sent when the thinker reports the unit that made it;
with tools offered, the message item's events start only when there is something to say in it.

and outputs of an older epoch than the session's are dropped here (the gateway half of the double
fence: the stages drop them too once they see the interrupt).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Protocol

import numpy as np

from gateway.realtime import events as ev
from gateway.realtime import metrics
from gateway.realtime.audio import AudioUnit, encode_output_audio
from gateway.realtime.conversation import FunctionCallItem
from gateway.realtime.errors import RealtimeError, error_type_for
from gateway.realtime.host import SessionCore
from gateway.realtime.pipeline.events import (
    AudioOut,
    PipelineEvent,
    PipelineFailure,
    SessionPipeline,
    StageAck,
    UnitOutcome,
    UnitRole,
)
from gateway.realtime.response_options import ResponseOptions, session_defaults
from gateway.tool_calls import ToolCallParser

# Turn lane: keep one silent unit queued behind the one being decided (False sends each only after the
# previous decision: the other arm of its A/B; the look-ahead won and is the default).
HELD_TAIL_SAMPLES = 480  # 20 ms at 24 kHz: what an audio delta keeps back for the turn's last delta
TURN_LOOKAHEAD = True


def status_details(status: str, reason: str) -> dict[str, Any] | None:
    """``response.done.response.status_details``: ``null`` for a completed response (GA's shape), else
    ``{type: status, reason}``; a failed response also carries GA's ``error{type, code}`` (``reason`` keeps
    the stable code, as the dialect's clients read it)."""
    if status == "completed":
        return None
    details: dict[str, Any] = {"type": status, "reason": reason}
    if status == "failed":
        details["error"] = {"type": error_type_for(reason), "code": reason}
    return details


class LifecycleHost(SessionCore, Protocol):
    """What the response lifecycle uses of its session (see ``gateway.realtime.host``)."""

    pipeline: SessionPipeline

    @property
    def state(self) -> str: ...

    @property
    def unit_seq(self) -> int: ...

    @property
    def interrupt_started(self) -> float | None: ...

    @property
    def units_in_flight(self) -> int: ...

    @property
    def response_unit_cap(self) -> int: ...

    @property
    def clock_exhausted(self) -> bool: ...

    def advance_epoch(self, reason: str) -> int: ...

    def forward_unit(self, unit: AudioUnit, role: UnitRole = UnitRole.PLAIN) -> int: ...

    def take_backlog(self) -> list[AudioUnit]: ...

    def tick_clock(self) -> None: ...

    def note_decision(self, unit_seq: int) -> None: ...

    def silence_unit(self) -> AudioUnit: ...


class ResponseLifecycle:
    """The responses of one session and the events that tell their story (owned by the session)."""

    def __init__(self, session: LifecycleHost) -> None:
        self.s = session
        self.active: ev.ResponseState | None = None
        self.last: ev.ResponseState | None = None
        self.responses: dict[str, ev.ResponseState] = {}
        self.deferred_create = False
        # Native lane: the model may start its next turn before the previous turn's audio is complete.
        # Its decisions and audio wait here until the previous response is done.
        self.queued_units: list[UnitOutcome] = []
        self.early_audio: dict[int, list[AudioOut]] = {}

    # ---------------------------------------------------------------- creation

    def create(
        self, lane: str, start_unit: int | None, options: ResponseOptions | None = None
    ) -> ev.ResponseState:
        s = self.s
        opts = options or session_defaults(s.cfg)
        resp = ev.ResponseState(
            id=ev.new_response_id(),
            epoch=s.epoch,
            lane=lane,
            modalities=list(opts.modalities),
            turn_id=s.turn_id,
            start_unit=start_unit,
            message_open=not opts.tools.active,
        )
        self.active = resp
        self.last = resp
        self.responses[resp.id] = resp
        s.emit(
            "response.created",
            response_id=resp.id,
            response={
                "id": resp.id,
                "object": "realtime.response",
                "status": "in_progress",
                "output": [],
                "modalities": resp.modalities,
                "output_modalities": resp.modalities,
                "max_output_tokens": opts.max_output_tokens or "inf",
                "metadata": ev.string_metadata(
                    {"epoch": resp.epoch, "duplex_event": {"epoch": resp.epoch, "lane": lane}}
                ),
            },
        )
        if resp.message_open:
            self._announce_message(resp)
        return resp

    def _announce_message(self, resp: ev.ResponseState) -> None:
        """The assistant message item enters the conversation and the response's output."""
        s = self.s
        previous = s.conversation.add(resp)
        item = resp.item("in_progress")
        s.emit("conversation.item.added", previous_item_id=previous, item=item)
        s.emit("conversation.item.created", previous_item_id=previous, item=item)
        s.emit("response.output_item.added", response_id=resp.id, output_index=resp.message_index, item=item)
        part = {"type": "audio", "transcript": ""} if resp.wants_audio else {"type": "text", "text": ""}
        s.emit(
            "response.content_part.added",
            **resp.part_ref(),
            part=part,
        )

    def _open_message(self, resp: ev.ResponseState) -> None:
        """A response with tools offered opens its message item with the first thing it says (after any call
        made before it); a native response announces its speech there."""
        if resp.message_open:
            return
        resp.message_index = len(resp.call_items)
        resp.message_open = True
        self._announce_message(resp)
        if resp.spoke and resp.lane == "native":
            self._emit_speak(resp)

    def _emit_speak(self, resp: ev.ResponseState) -> None:
        self.s.emit(
            "response.speak",
            **resp.part_ref(),
            metadata={"session_id": self.s.id, "epoch": resp.epoch, "model_speak": True},
        )

    def start_turn_response(self, options: ResponseOptions | None = None) -> None:
        """Open a response and send the committed audio, asking for an answer at its last unit (the turn
        lane's every response; in the native lane a ``response.create``, which starts the model's next turn
        at once). The requesting unit carries the response's instructions and token budget."""
        s = self.s
        opts = options or session_defaults(s.cfg)
        units = s.take_backlog()
        if not units:
            units = [s.silence_unit()]
        resp = self.create("turn", start_unit=None, options=opts)
        s.pipeline.begin_response(opts)
        first_seq = s.unit_seq
        for i, unit in enumerate(units):
            # Nobody hears an answer before the requesting unit, so the model only listens there.
            s.forward_unit(unit, UnitRole.REQUEST if i == len(units) - 1 else UnitRole.LISTEN)
        resp.start_unit = s.unit_seq - 1
        resp.units_sent = 1
        s.pipeline.allow_speech_from(resp.start_unit, first_seq)
        if TURN_LOOKAHEAD:
            self._feed_turn(resp)

    def _feed_turn(self, resp: ev.ResponseState) -> None:
        """Turn lane: one more 1 s silent unit so the model can keep talking, at most the response's unit
        cap. With the look-ahead one such unit is always queued behind the unit being decided, so the
        thinker encodes it meanwhile; it is sent as ``CONTINUE``, so if the unit before it ended the model's
        turn it is decided as listen and never starts a reply nobody asked for."""
        s = self.s
        if resp.units_sent >= s.response_unit_cap:
            return
        s.forward_unit(s.silence_unit(), UnitRole.CONTINUE)
        resp.units_sent += 1

    # ---------------------------------------------------------------- pipeline outputs

    async def on_pipeline(self, event: PipelineEvent) -> None:
        s = self.s
        if isinstance(event, StageAck):
            s.emit(
                "duplex.stage_interrupt_ack",
                session_id=s.id,
                event={"stage": event.stage, "epoch": event.new_epoch, "dropped_items": event.dropped},
            )
            return
        if isinstance(event, PipelineFailure):
            await self._on_failure(event)
            return
        if event.epoch < s.epoch:
            return  # gateway fence: late output of an interrupted epoch
        if isinstance(event, UnitOutcome):
            s.note_decision(event.unit_seq)
            self._on_unit(event)
        elif isinstance(event, AudioOut):
            self._on_audio(event)
        s.tick_clock()  # native lane after a final commit: the model may need its next silent unit

    def _on_unit(self, out: UnitOutcome) -> None:
        s = self.s
        resp = self.active
        speak = out.decision == "speak"
        if resp is not None and resp.start_unit is not None and out.unit_seq < resp.start_unit:
            return  # turn lane: a unit sent before the one that asked for the answer
        if resp is None:
            if s.cfg.auto_response and speak:
                resp = self.create("native", start_unit=out.unit_seq)
            else:
                if s.cfg.auto_response:
                    s.emit_listen("model_listen", unit_seq=out.unit_seq)
                return  # turn lane: the model only answers when asked
        if speak and out.speech_turn:
            if resp.speech_turn == 0:
                resp.speech_turn = out.speech_turn
            elif out.speech_turn != resp.speech_turn and resp.thinker_turn_ended:
                self.queued_units.append(out)  # the next model turn; it opens its own response
                return
        if resp.thinker_turn_ended:
            return  # a decision after the turn ended belongs to no response (the talker is finishing)
        resp.units_seen += 1
        resp.count_unit(out.context_before, out.context_tokens, out.output_tokens)
        if out.tool_error and not resp.tool_error_reported:
            resp.tool_error_reported = True
            s.emit_error(
                RealtimeError(
                    "invalid_value",
                    f"the function tools' grammar did not compile, so this turn ran without tools: {out.tool_error}",
                    param="tools",
                )
            )
        if speak:
            if not resp.spoke:
                resp.spoke = True
                if resp.lane == "native" and resp.message_open:
                    self._emit_speak(resp)
            if out.transcript:
                self._add_text(resp, out.transcript)
            if out.tool_call:
                resp.made_call = True
                self._add_call(resp, out.tool_call, out.tool_call_truncated)
        ended = out.turn_end or (not speak)
        if not speak and not resp.spoke:
            # The model declined to answer the requested turn: the listen terminates the response.
            s.emit_listen("model_listen", unit_seq=out.unit_seq, response_id=resp.id)
            s.pipeline.end_speech(resp.epoch, resp.speech_turn)
            self.finish(resp, "completed", "model_listen")
            return
        if not ended and resp.lane == "turn" and resp.units_seen >= s.response_unit_cap:
            ended = True
        if not ended and resp.lane == "native" and s.clock_exhausted and not s.units_in_flight:
            ended = True  # the last silent unit after a final commit: the response may not run longer
        if out.max_tokens_reached:
            resp.max_tokens_reached = True
        if ended:
            resp.thinker_turn_ended = True
            s.pipeline.end_speech(resp.epoch, resp.speech_turn)
            if not resp.wants_audio or (resp.made_call and not resp.speech_turn):
                # Text only, or a turn that was only a call: no talker stream was opened, no audio will come.
                self.finish(resp, *self._end_status(resp))
        elif resp.lane == "turn":
            self._feed_turn(resp)  # keep the model talking until it ends its turn

    def _add_text(self, resp: ev.ResponseState, text: str) -> None:
        self._open_message(resp)
        resp.pending_text += text
        if not resp.wants_audio:
            resp.transcript += resp.pending_text
            resp.pending_text = ""
            self.s.emit(
                "response.output_text.delta",
                **resp.part_ref(),
                delta=text,
            )

    def _add_call(self, resp: ev.ResponseState, text: str, truncated: bool) -> None:
        """The function call of a unit (its ``<tool_call>`` block, read by the chat route's parser) as an
        output item: added, its arguments (one delta: the thinker reports the call with the unit that made
        it), done. A call cut before its name was complete gives the client nothing to run: it only makes
        the response ``incomplete``."""
        s = self.s
        if truncated:
            resp.max_tokens_reached = True
        parser = ToolCallParser()
        _, fragments = parser.feed(text)
        fragments += parser.finish()[1]
        if not parser.calls:
            return
        call = parser.calls[0]
        index = resp.outputs_count
        item = FunctionCallItem(ev.new_item_id(), call.id, call.name, "", resp.id)
        previous = s.conversation.add(item)
        added = item.to_json()
        s.emit("conversation.item.added", previous_item_id=previous, item=added)
        s.emit("conversation.item.created", previous_item_id=previous, item=added)
        s.emit("response.output_item.added", response_id=resp.id, output_index=index, item=added)
        common: dict[str, Any] = {
            "response_id": resp.id,
            "item_id": item.id,
            "output_index": index,
            "call_id": call.id,
        }
        for fragment in fragments:
            delta = fragment["function"].get("arguments")
            if delta:
                s.emit("response.function_call_arguments.delta", delta=delta, **common)
        item.arguments = call.arguments
        item.status = "incomplete" if truncated else "completed"
        s.emit("response.function_call_arguments.done", name=call.name, arguments=call.arguments, **common)
        done = item.to_json()
        s.emit("response.output_item.done", response_id=resp.id, output_index=index, item=done)
        s.emit("conversation.item.done", item=done)
        resp.call_items.append((index, done))

    def _on_audio(self, out: AudioOut) -> None:
        resp = self.active
        if out.speech_turn and (resp is None or (resp.speech_turn and out.speech_turn != resp.speech_turn)):
            if resp is not None and out.speech_turn > resp.speech_turn:
                self.early_audio.setdefault(out.speech_turn, []).append(
                    out
                )  # next turn, held until its response
            return
        if resp is None or resp.epoch != out.epoch or not resp.wants_audio:
            return
        self._open_message(resp)
        held = resp.held_audio
        samples = out.samples if held is None else np.concatenate([held, out.samples])
        resp.held_audio = None
        if out.is_last:
            if samples.size:
                self._send_audio(resp, samples, end_of_turn=True)
            elif resp.pending_text:
                self._send_text_only(resp)
            self.finish(resp, *self._end_status(resp))
            return
        # Only a short tail is held back, so that the turn's last delta can carry end_of_turn with audio
        # in it; the rest goes out at once (holding a whole chunk delayed every delta, the first included,
        # by the time code2wav took for the next window).
        if samples.size > HELD_TAIL_SAMPLES:
            self._send_audio(resp, samples[:-HELD_TAIL_SAMPLES], end_of_turn=False)
            samples = samples[-HELD_TAIL_SAMPLES:]
        resp.held_audio = samples if samples.size else None

    @staticmethod
    def _end_status(resp: ev.ResponseState) -> tuple[str, str]:
        """A response whose turn ended by itself is ``completed``; one cut by its token budget is
        ``incomplete`` (GA's ``status_details.reason: max_output_tokens``)."""
        return ("incomplete", "max_output_tokens") if resp.max_tokens_reached else ("completed", "stop")

    def _send_audio(self, resp: ev.ResponseState, samples: np.ndarray, *, end_of_turn: bool) -> None:
        s = self.s
        payload, rate = encode_output_audio(samples, s.cfg.output_format)
        resp.audio_samples += samples.size
        metrics.AUDIO_SECONDS.inc(samples.size / 24_000)
        text, resp.pending_text = resp.pending_text, ""
        resp.transcript += text
        resp.marks.append(ev.TextMark(len(resp.transcript), resp.audio_ms))
        resp.audio_deltas += 1
        s.emit(
            "response.output_audio.delta",
            **resp.part_ref(),
            delta=base64.b64encode(payload).decode(),
            format=s.cfg.output_format,
            sample_rate_hz=rate,
            metadata={
                "session_id": s.id,
                "epoch": resp.epoch,
                "model_speak": True,
                "end_of_turn": end_of_turn,
                "audio_duration_ms": resp.audio_ms,
                "audio_text_marks": [m.to_json() for m in resp.marks],
                "playback": resp.playback(),
            },
        )
        resp.transcript_deltas += 1
        s.emit(
            "response.output_audio_transcript.delta",
            **resp.part_ref(),
            delta=text,
        )

    def _send_text_only(self, resp: ev.ResponseState) -> None:
        text, resp.pending_text = resp.pending_text, ""
        resp.transcript += text
        resp.marks.append(ev.TextMark(len(resp.transcript), resp.audio_ms))
        resp.transcript_deltas += 1
        self.s.emit(
            "response.output_audio_transcript.delta",
            **resp.part_ref(),
            delta=text,
            metadata={"session_id": self.s.id, "epoch": resp.epoch, "model_speak": True},
        )

    async def _on_failure(self, failure: PipelineFailure) -> None:
        """A stage stream failed: ``error`` (stable code), the active response ``failed``, then either the
        end of the session or a fence of the failed speaking turn.

        * Thinker (dead or unreachable ⇒ ``stage_unavailable``; an error in its stream, or the stream
          ending, ⇒ that error's code, else ``engine_error``): the thinker's duplex stream holds the
          session's conversation state, so the session cannot go on. It ends at once with
          ``session.closed{reason: code}`` and the socket closes; closing the pipeline cancels the
          talker/code2wav streams still open for it.
        * Talker or code2wav: only the voice of one speaking turn is lost (those streams are per turn and
          the next turn opens new ones, possibly on another replica), so only the response fails
          (docs/protocol.md, Realtime errors: ``error`` → ``response.done{status:"failed"}``). The rest of
          the model's turn is fenced like a hard interrupt (``epoch += 1``, ``Control.interrupt`` to the
          thinker) so it neither reopens a voice nor becomes a response of its own; the session stays open.
        """
        s = self.s
        if s.state != "open":
            return
        fatal = failure.stage == "thinker" or failure.code == "context_length_exceeded"
        if not fatal and failure.epoch < s.epoch:
            return  # the failed turn was already fenced (its response cancelled); nothing is lost now
        s.emit_error(RealtimeError(failure.code, failure.message, retryable=False))
        if fatal:
            self.deferred_create = False  # no new response can start on a dead thinker
            if self.active is not None:
                self.finish(self.active, "failed", failure.code)
            await s.end(failure.code)
            return
        s.advance_epoch("stage_failure")
        if self.active is not None:
            self.finish(self.active, "failed", failure.code)

    # ---------------------------------------------------------------- termination

    def finish(self, resp: ev.ResponseState, status: str, reason: str, *, cleared: bool = False) -> None:
        """Emit the terminal sequence once; afterwards nothing with this response id is sent."""
        s = self.s
        if resp.status != "in_progress":
            return
        resp.status = status
        if self.active is resp:
            self.active = None
        natural = status in ("completed", "incomplete")  # the model's turn ended (by itself or its budget)
        resp.held_audio = None if not natural else resp.held_audio
        if not natural:
            resp.pending_text = ""
            resp.history_transcript = resp.transcript_at(resp.committed_ms)
        if not resp.message_open and not resp.call_items:
            self._open_message(resp)  # a response without a call has its (possibly empty) message item
        if cleared:
            s.emit("output_audio_buffer.cleared", response_id=resp.id)
        outputs = [item for _, item in resp.call_items]
        if resp.message_open:
            outputs.insert(resp.message_index, self._finish_message(resp, status))
        metadata: dict[str, Any] = {
            "epoch": s.epoch,
            "playback": resp.playback(),
            "committed_ms": resp.committed_ms,
        }
        if status == "completed":
            # "stop", "model_listen" or "tool_calls"; GA's status_details is null here
            metadata["finish_reason"] = "tool_calls" if resp.call_items else reason
        if status == "cancelled":
            metadata["cancelled_epoch"] = resp.epoch
        s.emit(
            "response.done",
            response_id=resp.id,
            response={
                "id": resp.id,
                "object": "realtime.response",
                "status": status,
                "status_details": status_details(status, reason),
                "output": outputs,
                "modalities": resp.modalities,
                "output_modalities": resp.modalities,
                "metadata": ev.string_metadata(metadata),
                "usage": resp.usage(),
            },
        )
        s.emit("rate_limits.updated", rate_limits=[])
        metrics.RESPONSES.labels(status).inc()
        if not natural:
            self.queued_units.clear()
            self.early_audio.clear()
        elif self.queued_units and self.active is None:
            queued, self.queued_units = self.queued_units, []
            for out in queued:
                self._on_unit(out)
            if self.active is not None:
                for audio in self.early_audio.pop(self.active.speech_turn, []):
                    self._on_audio(audio)
        if status == "cancelled" and s.interrupt_started is not None:
            metrics.BARGE_IN_GATEWAY.observe(time.monotonic() - s.interrupt_started)
        if self.deferred_create and self.active is None:
            self.deferred_create = False
            if s.committed_backlog:
                self.start_turn_response()

    def _finish_message(self, resp: ev.ResponseState, status: str) -> dict[str, Any]:
        """The message item's terminal events; returns its final JSON."""
        s = self.s
        common = resp.part_ref()
        if resp.wants_audio:
            if resp.audio_deltas or resp.transcript or status != "completed":
                s.emit("response.output_audio.done", **common)
            if resp.transcript:
                s.emit("response.output_audio_transcript.done", transcript=resp.transcript, **common)
        else:
            s.emit("response.output_text.done", text=resp.transcript, **common)
        s.emit("response.content_part.done", part=resp.content_part(), **common)
        item_status = {"completed": "completed", "cancelled": "cancelled"}.get(status, "incomplete")
        item = resp.item(item_status)
        s.emit("response.output_item.done", response_id=resp.id, output_index=resp.message_index, item=item)
        s.emit("conversation.item.done", item=item)
        return item

    def supersede_all(self) -> None:
        """A user turn was committed: playback acks of every earlier response come too late from now on.

        In the native lane the response running at the commit is not earlier than it: the model keeps
        talking over (and, after a final commit, past) the user's input, so its acks stay welcome.
        """
        for resp in self.responses.values():
            if resp is self.active and self.s.cfg.auto_response:
                continue
            resp.superseded_by_user_turn = True

    def defer_create(self) -> None:
        """Turn lane: a response was asked for while one runs; it starts when the running one is done."""
        self.deferred_create = True

    def cancel_active(self, reason: str, *, cleared: bool = False) -> bool:
        """A hard interrupt: a deferred response.create is dropped and the active response cancelled."""
        self.deferred_create = False
        if self.active is None:
            return False
        self.finish(self.active, "cancelled", reason, cleared=cleared)
        return True

    def abort_silently(self) -> None:
        """Session teardown: drop the active response without a cancelled response.done (docs/protocol.md,
        Realtime session end)."""
        if self.active is not None:
            self.active.status = "aborted"
            self.active = None
            # No response.done goes out, but the response still ended: count it (client gone, shutdown).
            metrics.RESPONSES.labels("abandoned").inc()
