"""Client → server commands of an open session (docs/protocol.md, Realtime commands).

Each handler validates its event fully before changing any state, so a rejected event leaves the
session exactly as it was (malformed frames never derail a session).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from gateway.realtime import events as ev
from gateway.realtime.audio import (
    canonical_input_format,
    decode_input_audio,
    default_rate_for,
    rms,
    strict_b64decode,
    validate_rate,
)
from gateway.realtime.config import SessionConfig, parse_session
from gateway.realtime.conversation import FunctionCallItem, FunctionCallOutputItem, Item, UserItem
from gateway.realtime.errors import RealtimeError
from gateway.realtime.journal import EventJournal
from gateway.realtime.response_options import parse_response_options
from gateway.realtime.server_vad import VadHost
from gateway.realtime.video import decode_video_frames


class CommandHost(VadHost, Protocol):
    """What the client-command handlers use of the session (see ``gateway.realtime.host``)."""

    journal: EventJournal

    def buffered_input_bytes(self) -> int: ...

    def drop_input(self) -> None: ...

    def input_resumed(self) -> None: ...

    def reconfigure(self, cfg: SessionConfig) -> None: ...

    @property
    def tool_results_waiting(self) -> bool: ...

    def add_tool_output(self, call: FunctionCallItem, output: str) -> None: ...


Handler = Callable[[CommandHost, dict[str, Any]], Awaitable[None]]


async def dispatch(s: CommandHost, event: dict[str, Any]) -> None:
    kind = event.get("type")
    handler = HANDLERS.get(kind) if isinstance(kind, str) else None
    if handler is None:
        raise RealtimeError("unknown_event", f"unknown event type {kind!r}", param="type")
    await handler(s, event)


# ------------------------------------------------------------------------------------------ session


async def session_update(s: CommandHost, event: dict[str, Any]) -> None:
    s.reconfigure(
        parse_session(
            event.get("session"),
            current=s.cfg,
            audio_started=s.input.started,
            voices=s.settings.voice_lookup,
        )
    )


async def session_resume_mid_session(s: CommandHost, event: dict[str, Any]) -> None:
    raise RealtimeError("unsupported_session_resume", "session.resume is only valid as the first message")


async def event_ack(s: CommandHost, event: dict[str, Any]) -> None:
    s.journal.ack(event.get("server_event_seq"))


async def heartbeat(s: CommandHost, event: dict[str, Any]) -> None:
    s.emit("session.heartbeat_ack", session_id=s.id)


async def close(s: CommandHost, event: dict[str, Any]) -> None:
    reason = event.get("reason")
    await s.end(reason if isinstance(reason, str) and reason else "client_close")


# ------------------------------------------------------------------------------------------ input


def _is_speech(s: CommandHost, event: dict[str, Any], samples: np.ndarray) -> bool:
    """The client's speech flag or probability on the append, else an energy check of the audio."""
    for key in ("is_speech", "speech"):
        flag = event.get(key)
        if isinstance(flag, bool):
            return flag
    prob = event.get("speech_probability")
    vad = event.get("vad")
    if prob is None and isinstance(vad, dict):
        prob = vad.get("speech_probability")
    if isinstance(prob, (int, float)) and not isinstance(prob, bool):
        return prob >= 0.5
    return rms(samples) >= s.settings.overlap_silence_rms


async def append(s: CommandHost, event: dict[str, Any]) -> None:
    audio_b64 = event.get("audio", event.get("delta"))
    fmt_name = event.get("format", event.get("input_audio_format"))
    fmt = canonical_input_format(fmt_name) if fmt_name is not None else s.cfg.input_format
    declared = event.get("sample_rate_hz", event.get("sample_rate"))
    if declared is not None:
        rate = validate_rate(declared, "sample_rate_hz")
    else:
        rate = s.cfg.input_rate if fmt == s.cfg.input_format else default_rate_for(fmt)
    frames = decode_video_frames(event.get("video_frames"), event.get("max_slice_nums"))
    if audio_b64 is None or audio_b64 == "":
        if frames:
            raise RealtimeError(
                "invalid_input_modality", "MiniCPM-o needs audio on every append", param="audio"
            )
        raise RealtimeError("bad_event", "input_audio_buffer.append needs base64 audio", param="audio")
    raw = strict_b64decode(audio_b64)
    samples = decode_input_audio(raw, fmt, rate)
    if s.buffered_input_bytes() + samples.size * 4 > s.settings.max_pending_input_bytes:
        raise RealtimeError("input_backpressure", "too much pending input audio; commit or clear first")
    speech = _is_speech(s, event, samples)

    force = event.get("force_barge_in") is True or event.get("overlap_action") == "barge_in"
    active = s.lifecycle.active
    if force and active is not None:
        if not s.settings.supports_barge_in:
            raise RealtimeError("barge_in_unsupported", "this deployment does not support barge-in")
        s.emit(
            "overlap.decision",
            session_id=s.id,
            epoch=s.epoch,
            policy=s.cfg.overlap_policy,
            action="barge_in",
            reason="client_force_barge_in",
            metadata={"response_id": active.id},
        )
        s.interrupt("barge_in")
    elif active is not None and not s.cfg.auto_response and s.server_vad is None:
        s.emit(
            "overlap.decision",
            session_id=s.id,
            epoch=s.epoch,
            policy=s.cfg.overlap_policy,
            action="listen",
            reason="policy_listen_only",
            metadata={"response_id": active.id},
        )

    s.input_resumed()
    s.input.note_append(samples.size)
    if s.server_vad is not None:
        s.server_vad.push(samples, frames)
        if not s.cfg.auto_response:
            return  # turn lane: server VAD routes the audio (pre-roll, speech into the buffer)
    for unit in s.input.push(samples, frames, speech):
        s.accept_units([unit])
        if not s.cfg.auto_response and not unit.is_speech and s.lifecycle.active is None:
            s.emit_listen("silence_or_noise")


async def commit(s: CommandHost, event: dict[str, Any]) -> None:
    create = event.get("response_create", event.get("create_response"))
    if create is None and event.get("type") == "input.commit":
        create = True
    if create is not None and not isinstance(create, bool):
        raise RealtimeError("bad_event", "response_create must be a boolean", param="response_create")
    final = event.get("final", True)
    if not isinstance(final, bool):
        raise RealtimeError("bad_event", "final must be a boolean", param="final")
    if not s.input.has_audio:
        raise RealtimeError(
            "input_audio_buffer_empty", "input_audio_buffer.commit requires a non-empty input audio buffer"
        )
    if not s.cfg.auto_response and s.pending_commits() >= s.settings.max_pending_commits:
        raise RealtimeError(
            "input_backpressure", f"more than {s.settings.max_pending_commits} pending commits"
        )
    item_id = None
    if s.server_vad is not None:
        # The client took the turn boundary into its own hands: the item announced by speech_started (if
        # any) ends here, and the detector starts over.
        item_id = s.server_vad.item_id
        s.server_vad.reset()
    speech = s.input.has_speech and event.get("is_speech") is not False
    s.seal_input(create=bool(create), speech=speech, item_id=item_id, final=final)


async def clear(s: CommandHost, event: dict[str, Any]) -> None:
    s.drop_input()
    s.emit("input_audio_buffer.cleared")


async def input_cancel(s: CommandHost, event: dict[str, Any]) -> None:
    s.drop_input()
    s.emit("input_audio_buffer.cleared")
    s.interrupt("barge_in")


async def text_append(s: CommandHost, event: dict[str, Any]) -> None:
    raise RealtimeError("native_text_append_unsupported", "MiniCPM-o duplex sessions take audio input only")


# ------------------------------------------------------------------------------------------ interrupts


async def barge_in(s: CommandHost, event: dict[str, Any]) -> None:
    if not s.settings.supports_barge_in:
        raise RealtimeError("barge_in_unsupported", "this deployment does not support barge-in")
    s.drop_input()
    s.emit("input_audio_buffer.cleared")
    s.interrupt("barge_in")


async def response_cancel(s: CommandHost, event: dict[str, Any]) -> None:
    rid = event.get("response_id")
    active = s.lifecycle.active
    if active is None or (rid is not None and rid != active.id):
        raise RealtimeError(
            "response_not_active",
            f"response {rid or ''} is not active".replace("  ", " "),
            param="response_id",
        )
    s.interrupt("client_cancelled")


async def output_clear(s: CommandHost, event: dict[str, Any]) -> None:
    rid = event.get("response_id")
    active = s.lifecycle.active
    if active is not None and (rid is None or rid == active.id):
        s.interrupt("output_audio_buffer_clear", cleared=True)
        return
    last = s.lifecycle.last
    s.emit("output_audio_buffer.cleared", response_id=rid or (last.id if last else None))


async def turn_signal(s: CommandHost, event: dict[str, Any]) -> None:
    target = event.get("event")
    routed = {"barge_in", "input.cancel", "response.cancel", "session.update"}
    if not isinstance(target, str) or not (target in routed or target.startswith("conversation.item.")):
        raise RealtimeError("bad_event", "turn.signal needs a routable event", param="event")
    payload = event.get("payload") or {}
    if not isinstance(payload, dict):
        raise RealtimeError("bad_event", "turn.signal payload must be an object", param="payload")
    await dispatch(s, {**payload, "type": target})


async def response_create(s: CommandHost, event: dict[str, Any]) -> None:
    options = parse_response_options(event.get("response"), s.cfg)
    if s.lifecycle.active is not None:
        raise RealtimeError("response_already_active", "a response is already in progress")
    if not s.committed_backlog and not s.tool_results_waiting and (not s.cfg.auto_response or s.turn_id == 0):
        raise RealtimeError(
            "response_create_without_input",
            "response.create needs committed audio input or a function_call_output",
        )
    s.lifecycle.start_turn_response(options)


# ------------------------------------------------------------------------------------------ playback


def _ack_target(s: CommandHost, event: dict[str, Any]) -> ev.ResponseState:
    rid = event.get("response_id")
    item_id = event.get("item_id")
    if rid is not None and item_id is not None and item_id != ev.assistant_item_id(rid):
        raise RealtimeError(
            "playback_item_mismatch", "item_id does not belong to response_id", param="item_id"
        )
    if rid is not None:
        resp = s.lifecycle.responses.get(rid)
        if resp is None:
            raise RealtimeError("playback_item_not_found", f"unknown response {rid}", param="response_id")
        return resp
    last = s.lifecycle.last
    if last is None:
        raise RealtimeError("playback_item_not_found", "no assistant audio has been sent", param="item_id")
    if item_id is not None and item_id != last.item_id:
        known = s.conversation.get(item_id)
        if known is None and not str(item_id).startswith("item_resp_"):
            raise RealtimeError(
                "playback_item_mismatch", "item_id is not the current assistant item", param="item_id"
            )
        if not isinstance(known, ev.ResponseState):
            raise RealtimeError("playback_item_mismatch", "item_id is not an assistant item", param="item_id")
        return known
    return last


async def playback_ack(s: CommandHost, event: dict[str, Any]) -> None:
    played = event.get("played_ms")
    if isinstance(played, bool) or not isinstance(played, (int, float)) or played < 0:
        raise RealtimeError("bad_event", "played_ms must be a non-negative number", param="played_ms")
    committed = event.get("committed_ms", played)
    if isinstance(committed, bool) or not isinstance(committed, (int, float)) or committed < 0:
        raise RealtimeError("bad_event", "committed_ms must be a non-negative number", param="committed_ms")
    resp = _ack_target(s, event)
    if resp.superseded_by_user_turn and resp.status != "in_progress":
        raise RealtimeError("playback_ack_too_late", "a later user turn was committed after this response")
    resp.ack_playback(int(played), int(committed))
    s.emit(
        "playback.acknowledged",
        event={
            "item_id": resp.item_id,
            "response_id": resp.id,
            "played_ms": int(played),
            "committed_ms": int(committed),
            "truncate": False,
            "playback": resp.playback(),
            "history_committed": resp.status != "in_progress",
        },
    )


# ------------------------------------------------------------------------------------------ items


def _lookup_item(s: CommandHost, event: dict[str, Any]) -> tuple[str, Item]:
    item_id = event.get("item_id")
    if not isinstance(item_id, str) or not item_id:
        raise RealtimeError("missing_item_id", "item_id is required", param="item_id")
    entry = s.conversation.get(item_id)
    if entry is None:
        raise RealtimeError("item_not_found", f"no item {item_id}", param="item_id")
    return item_id, entry


def _item_json(entry: Item) -> dict[str, Any]:
    if isinstance(entry, (UserItem, FunctionCallItem, FunctionCallOutputItem)):
        return entry.to_json()
    resp = entry
    status = {"in_progress": "in_progress", "completed": "completed", "cancelled": "cancelled"}.get(
        resp.status, "incomplete"
    )
    item = resp.item(status)
    transcript = resp.history_transcript if resp.history_transcript is not None else resp.transcript
    item["content"] = [resp.item_content(transcript)]
    item["metadata"] = {
        "audio_ms": resp.audio_ms,
        "committed_ms": resp.committed_ms,
        "audio_text_marks": [m.to_json() for m in resp.marks],
    }
    return item


async def item_retrieve(s: CommandHost, event: dict[str, Any]) -> None:
    _, entry = _lookup_item(s, event)
    s.emit("conversation.item.retrieved", item=_item_json(entry))


async def item_delete(s: CommandHost, event: dict[str, Any]) -> None:
    item_id, entry = _lookup_item(s, event)
    if isinstance(entry, ev.ResponseState) and entry.status == "in_progress":
        raise RealtimeError(
            "item_in_progress", "cancel the response before deleting its item", param="item_id"
        )
    s.conversation.delete(item_id)
    s.emit("conversation.item.deleted", item_id=item_id, event={"item_id": item_id})


async def item_truncate(s: CommandHost, event: dict[str, Any]) -> None:
    item_id, resp = _lookup_item(s, event)
    if not isinstance(resp, ev.ResponseState) or not resp.wants_audio:
        raise RealtimeError(
            "invalid_item_type", "only assistant audio items can be truncated", param="item_id"
        )
    end_ms = event.get("audio_end_ms")
    if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
        raise RealtimeError("bad_event", "audio_end_ms must be a non-negative integer", param="audio_end_ms")
    if event.get("content_index", 0) != 0:
        raise RealtimeError("bad_event", "content_index must be 0", param="content_index")
    if end_ms > resp.audio_ms:
        raise RealtimeError(
            "invalid_audio_end_ms",
            f"audio_end_ms {end_ms} exceeds the item's {resp.audio_ms} ms of audio",
            param="audio_end_ms",
        )
    if resp.status == "in_progress":
        s.interrupt("client_cancelled")
    resp.truncate(end_ms)
    s.emit(
        "conversation.item.truncated",
        item_id=item_id,
        content_index=0,
        audio_end_ms=end_ms,
        event={"item_id": item_id, "audio_end_ms": end_ms, "transcript": resp.history_transcript},
    )


async def item_create(s: CommandHost, event: dict[str, Any]) -> None:
    item = event.get("item")
    if not isinstance(item, dict):
        raise RealtimeError("bad_event", "item must be an object", param="item")
    if item.get("type") == "function_call_output":
        _function_call_output(s, item)
        return
    if item.get("type") == "function_call":
        raise RealtimeError(
            "unsupported_item_type",
            "function_call items are the model's own (its context holds them); send function_call_output",
            param="item.type",
        )
    content = item.get("content")
    if item.get("role", "user") != "user" or not isinstance(content, list) or not content:
        raise RealtimeError("bad_event", "only user items with content are accepted", param="item")
    audio_parts = [p for p in content if isinstance(p, dict) and p.get("type") == "input_audio"]
    if len(audio_parts) != len(content):
        raise RealtimeError(
            "text_only_turn_unsupported",
            "only input_audio content is accepted; seed text via initial_user_text",
            param="item.content",
        )
    for part in audio_parts:
        await append(
            s, {"type": "input_audio_buffer.append", "audio": part.get("audio"), "format": part.get("format")}
        )
    await commit(s, {"type": "input_audio_buffer.commit", "response_create": False})


MAX_TOOL_OUTPUT_CHARS = 32_000


def _function_call_output(s: CommandHost, item: dict[str, Any]) -> None:
    """The client's result of a call the model made: checked (the ``call_id`` must name a function call of
    this conversation that has no output yet), then queued for the model's next unit."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RealtimeError(
            "invalid_value", "item.call_id must be the call_id of a function call", param="item.call_id"
        )
    output = item.get("output")
    if not isinstance(output, str):
        raise RealtimeError("invalid_value", "item.output must be a string", param="item.output")
    if len(output) > MAX_TOOL_OUTPUT_CHARS:
        raise RealtimeError(
            "invalid_value",
            f"item.output is longer than {MAX_TOOL_OUTPUT_CHARS} characters",
            param="item.output",
        )
    call = s.conversation.find_call(call_id)
    if call is None:
        raise RealtimeError(
            "invalid_value",
            f"no function call with call_id {call_id[:80]!r} in this conversation",
            param="item.call_id",
        )
    if call.answered:
        raise RealtimeError(
            "invalid_value", f"the function call {call_id[:80]!r} already has an output", param="item.call_id"
        )
    s.add_tool_output(call, output)


HANDLERS: dict[str, Handler] = {
    "session.update": session_update,
    "session.resume": session_resume_mid_session,
    "session.event_ack": event_ack,
    "session.heartbeat": heartbeat,
    "session.close": close,
    "close": close,
    "close_session": close,
    "input_audio_buffer.append": append,
    "input_audio_buffer.commit": commit,
    "input.commit": commit,
    "input_audio_buffer.clear": clear,
    "input.cancel": input_cancel,
    "input.text.append": text_append,
    "input_text.append": text_append,
    "push_text": text_append,
    "conversation.item.create": item_create,
    "conversation.item.retrieve": item_retrieve,
    "conversation.item.delete": item_delete,
    "conversation.item.truncate": item_truncate,
    "response.create": response_create,
    "response.cancel": response_cancel,
    "output_audio_buffer.clear": output_clear,
    "barge_in": barge_in,
    "turn.signal": turn_signal,
    "signal_turn": turn_signal,
    "playback.ack": playback_ack,
    "audio.playback_ack": playback_ack,
}
