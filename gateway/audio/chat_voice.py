"""Chat ``audio.voice``: a registered voice name resolves to its stored clip and code2wav features."""

from __future__ import annotations

from fastapi import Request

from gateway.audio.common import voice_registry
from gateway.audio.voices import RegisteredVoice


def resolve_chat_voice(request: Request, body: object) -> RegisteredVoice | None:
    """The registered voice a chat body's ``audio.voice`` names; None for none, ``default`` or an OpenAI
    built-in name; a 400 (param ``audio.voice``) for an unknown name."""
    audio = body.get("audio") if isinstance(body, dict) else None
    name = audio.get("voice") if isinstance(audio, dict) else None
    if isinstance(name, dict):  # OpenAI's newer form: {"id": "<voice>"}
        name = name.get("id")
    if name is None:
        return None
    return voice_registry(request).resolve(str(name), "audio.voice")
