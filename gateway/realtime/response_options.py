"""Per-response options of ``response.create`` (docs/realtime.md, Responses: per-response options).

A response may override, for itself only, the session's output modalities and function tools, add
instructions and cap its length. Both lanes honour them: the turn lane on the unit that asks for the answer, the native lane on the
unit that ``response.create`` sends to start the model's next turn. Everything is validated before the
session changes (an invalid option answers ``error`` with the exact ``param``; the session goes on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.realtime.config import SessionConfig
from gateway.realtime.errors import RealtimeError
from gateway.realtime.tools import ToolSet, parse_tools

# Accepted and applied; every other key of the ``response`` object is refused by name.
KNOWN_OPTIONS = frozenset(
    {
        "output_modalities",
        "modalities",
        "instructions",
        "max_output_tokens",
        "max_response_output_tokens",
        "metadata",
        "conversation",
        "input",
        "audio",
        "output_audio_format",  # the dialect's key; audio deltas keep the session's format
        "extra_body",  # the dialect's extension object; no per-response key is read from it
        "tools",  # function tools for this response (gateway/realtime/tools.py)
        "tool_choice",
    }
)
# Known to OpenAI's Realtime API and refused here, with the reason in the message.
REFUSED_OPTIONS = {
    "voice": "the voice is the session's reference voice (ref_audio)",
    "temperature": "sampling is fixed per session",
    "prompt": "stored prompts are not supported",
    "tracing": "tracing is not supported",
}
MAX_INSTRUCTIONS_CHARS = 16_000
MAX_OUTPUT_TOKENS = 4096


@dataclass(frozen=True)
class ResponseOptions:
    """What one response asks for beyond the session's defaults."""

    modalities: list[str] = field(default_factory=lambda: ["text", "audio"])
    instructions: str = ""
    max_output_tokens: int = 0  # 0 = no budget
    tools: ToolSet = field(default_factory=ToolSet)  # the session's, or this response's own

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


def session_defaults(cfg: SessionConfig) -> ResponseOptions:
    """The options of a response nobody configured (a model-initiated native response, a server-VAD turn)."""
    return ResponseOptions(
        modalities=list(cfg.modalities),
        max_output_tokens=cfg.max_response_output_tokens or 0,
        tools=cfg.tools,
    )


def _modalities(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise RealtimeError(
            "invalid_value", f"{param} must be a non-empty subset of [text, audio]", param=param
        )
    if value == ["audio"]:
        return ["text", "audio"]  # GA's "audio" output always carries its transcript
    return list(dict.fromkeys(value))


def _max_tokens(value: Any, param: str) -> int:
    if value == "inf":
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RealtimeError("invalid_value", f'{param} must be an integer or "inf"', param=param)
    if value != int(value) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise RealtimeError(
            "invalid_value", f'{param} must be an integer in [1, {MAX_OUTPUT_TOKENS}] or "inf"', param=param
        )
    return int(value)


def parse_response_options(options: Any, cfg: SessionConfig) -> ResponseOptions:
    """Validate the ``response`` object of ``response.create`` against the session; raises ``RealtimeError``
    naming the exact field (``response.max_output_tokens``, ``response.output_modalities``, …)."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise RealtimeError("bad_event", "response must be an object", param="response")
    for key in options:
        if key in REFUSED_OPTIONS:
            raise RealtimeError(
                "unsupported_native_response_options",
                f"response.{key} is not supported: {REFUSED_OPTIONS[key]}",
                param=f"response.{key}",
            )
        if key not in KNOWN_OPTIONS:
            raise RealtimeError("unknown_parameter", f"unknown field response.{key}", param=f"response.{key}")
    tools = parse_tools(options, "response", cfg.tools)
    if options.get("conversation") not in (None, "auto"):
        raise RealtimeError(
            "unsupported_native_response_options",
            "only conversation 'auto' is supported (the model's context is the session's)",
            param="response.conversation",
        )
    if options.get("input") is not None:
        raise RealtimeError(
            "unsupported_native_response_options",
            "a custom response input is not supported (the model's context is the session's)",
            param="response.input",
        )
    base = session_defaults(cfg)
    modalities = base.modalities
    key = "output_modalities" if "output_modalities" in options else "modalities"
    if options.get(key) is not None:
        modalities = _modalities(options[key], f"response.{key}")
    if options.get(key) is not None and "audio" in modalities and cfg.ref_audio is None:
        raise RealtimeError(
            "missing_reference_audio",
            "a spoken response needs the session's reference voice (ref_audio)",
            param=f"response.{key}",
        )
    audio = options.get("audio")
    if audio is not None and not isinstance(audio, dict):
        raise RealtimeError("bad_event", "response.audio must be an object", param="response.audio")
    if isinstance(audio, dict) and isinstance(audio.get("output"), dict) and "voice" in audio["output"]:
        raise RealtimeError(
            "unsupported_native_response_options",
            "response.audio.output.voice is not supported: the voice is the session's reference voice",
            param="response.audio.output.voice",
        )
    instructions = options.get("instructions")
    if instructions is None:
        instructions = ""
    if not isinstance(instructions, str):
        raise RealtimeError(
            "invalid_value", "response.instructions must be a string", param="response.instructions"
        )
    if len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise RealtimeError(
            "invalid_value",
            f"response.instructions is longer than {MAX_INSTRUCTIONS_CHARS} characters",
            param="response.instructions",
        )
    budget = base.max_output_tokens
    key = "max_output_tokens" if "max_output_tokens" in options else "max_response_output_tokens"
    if options.get(key) is not None:
        budget = _max_tokens(options[key], f"response.{key}")
    metadata = options.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RealtimeError("invalid_value", "response.metadata must be an object", param="response.metadata")
    return ResponseOptions(
        modalities=modalities, instructions=instructions.strip(), max_output_tokens=budget, tools=tools
    )
