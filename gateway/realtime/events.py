"""Server event construction: ids and the shapes of items, responses and audio deltas (docs/protocol.md,
Realtime events)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _json_default(value: Any) -> Any:
    """numpy scalars and arrays (easy to leak from audio or model code into an event) as plain JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_event(event: dict[str, Any]) -> str:
    """The wire text of one server event; the journal sizes events with the same encoder.

    One encoder for both means an event that was journaled can always be sent; anything still not
    serialisable raises ``TypeError``/``ValueError`` here, where the caller can name the event.
    """
    return json.dumps(event, separators=(",", ":"), default=_json_default)


def string_metadata(values: dict[str, Any]) -> dict[str, str]:
    """A ``response.metadata`` object as GA wants it: every value a string (objects as compact JSON).

    OpenAI's Realtime GA types ``response.metadata`` as a map of strings and its SDK warns on anything
    else; the vLLM-Omni dialect leaves the values free, and its client never reads them.
    """
    return {k: v if isinstance(v, str) else encode_event(v) for k, v in values.items()}


def new_event_id() -> str:
    return f"event_{secrets.token_hex(16)}"


def new_session_id() -> str:
    return f"duplex-{secrets.token_hex(16)}"


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(12)}"


def new_user_item_id() -> str:
    return f"item_{secrets.token_hex(12)}"


def new_item_id() -> str:
    """The id of an item that is neither a user turn nor an assistant message (function calls, outputs)."""
    return f"item_{secrets.token_hex(12)}"


def assistant_item_id(response_id: str) -> str:
    return f"item_{response_id}"


@dataclass
class TextMark:
    """After ``audio_end_ms`` of assistant audio, ``text_chars`` characters of transcript were spoken."""

    text_chars: int
    audio_end_ms: int

    def to_json(self) -> dict[str, int]:
        return {"text_chars": self.text_chars, "audio_end_ms": self.audio_end_ms}


@dataclass
class ResponseState:
    """One assistant utterance, from ``response.created`` to ``response.done``."""

    id: str
    epoch: int
    lane: str  # "native" | "turn"
    modalities: list[str]
    turn_id: int
    start_unit: int | None = None
    status: str = "in_progress"
    spoke: bool = False
    transcript: str = ""
    pending_text: str = ""
    audio_samples: int = 0  # 24 kHz samples sent
    audio_deltas: int = 0
    transcript_deltas: int = 0
    marks: list[TextMark] = field(default_factory=list)
    held_audio: Any = None  # float32 24 kHz tail (20 ms) held back so the last delta can carry end_of_turn
    thinker_turn_ended: bool = False
    units_seen: int = 0
    units_sent: int = 0  # turn lane: units sent for this response (the requesting one and silent ones)
    played_ms: int = 0
    committed_ms: int = 0
    history_transcript: str | None = None
    superseded_by_user_turn: bool = False
    speech_turn: int = 0  # the pipeline's speaking turn voicing this response (0: not known yet)
    max_tokens_reached: bool = False  # the model's turn was ended by the response's max_output_tokens
    # Usage: the session's thinker context before the response's first unit (held in its KV: cached),
    # after its latest unit, and the tokens the thinker generated on the response's units.
    context_before: int | None = None
    context_after: int = 0
    output_tokens: int = 0
    # Output items. With function tools offered the message item is opened only once there is something
    # to say in it (a response that only calls a function has none); a call is its own item, at the
    # output index it took. ``call_items``: (output_index, final item JSON) of each call made.
    message_open: bool = True
    message_index: int = 0
    call_items: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    tool_error_reported: bool = False
    made_call: bool = False  # the model called (even a call cut before it could be read)

    @property
    def outputs_count(self) -> int:
        return len(self.call_items) + (1 if self.message_open else 0)

    def count_unit(self, context_before: int, context_after: int, output_tokens: int) -> None:
        """A unit decided for this response: its context and its output go into the usage."""
        if self.context_before is None:
            self.context_before = context_before
        self.context_after = max(self.context_after, context_after)
        self.output_tokens += output_tokens

    def usage(self) -> dict[str, Any]:
        """``response.done`` usage in thinker tokens: the input is the context the model read for this
        response (everything but its own output); of it, the context the session already held before the
        response's first unit was not computed again (its KV is the session's, including a session prefix
        found in the thinker's prefix cache): ``input_token_details.cached_tokens``."""
        cached = self.context_before or 0
        inputs = max(cached, self.context_after - self.output_tokens)
        return {
            "total_tokens": inputs + self.output_tokens,
            "input_tokens": inputs,
            "output_tokens": self.output_tokens,
            "input_token_details": {"cached_tokens": cached},
        }

    @property
    def item_id(self) -> str:
        return assistant_item_id(self.id)

    @property
    def audio_ms(self) -> int:
        return self.audio_samples * 1000 // 24_000

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    def transcript_at(self, audio_ms: int) -> str:
        """Transcript prefix spoken by ``audio_ms`` of playback, from the audio/text marks."""
        chars = 0
        for mark in self.marks:
            if mark.audio_end_ms <= audio_ms:
                chars = mark.text_chars
        return self.transcript[:chars]

    def content_part(self) -> dict[str, Any]:
        """The ``part`` of ``response.content_part.added/done``: GA types ``audio`` / ``text`` there."""
        if self.wants_audio:
            return {"type": "audio", "transcript": self.transcript}
        return {"type": "text", "text": self.transcript}

    def item_content(self, transcript: str | None = None) -> dict[str, Any]:
        """One content entry of the assistant item: GA types ``output_audio`` / ``output_text`` (the
        vLLM-Omni dialect's clients do not read the type, stock OpenAI clients validate it)."""
        text = self.transcript if transcript is None else transcript
        if self.wants_audio:
            return {"type": "output_audio", "transcript": text}
        return {"type": "output_text", "text": text}

    def part_ref(self) -> dict[str, Any]:
        """The fields that name the message's one content part, common to its part and delta events."""
        return {
            "response_id": self.id,
            "item_id": self.item_id,
            "output_index": self.message_index,
            "content_index": 0,
        }

    def item(self, status: str) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self.item_content()] if status != "in_progress" else [],
        }

    def ack_playback(self, played_ms: int, committed_ms: int) -> None:
        """A client playback ack: positions only grow and never pass the audio sent; a cancelled response's
        history keeps what was committed."""
        self.played_ms = max(self.played_ms, min(played_ms, self.audio_ms))
        self.committed_ms = max(self.committed_ms, min(committed_ms, self.audio_ms))
        if self.status == "cancelled":
            self.history_transcript = self.transcript_at(self.committed_ms)

    def truncate(self, end_ms: int) -> None:
        """``conversation.item.truncate``: the history keeps the audio (and text) up to ``end_ms``."""
        self.committed_ms = end_ms
        self.history_transcript = self.transcript_at(end_ms)

    def playback(self) -> dict[str, int]:
        return {
            "generated_ms": self.audio_ms,
            "sent_ms": self.audio_ms,
            "played_ms": self.played_ms,
            "committed_ms": self.committed_ms,
        }
