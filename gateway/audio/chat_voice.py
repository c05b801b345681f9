"""Chat ``audio.voice``: a registered voice name resolves to the stages' stored features."""

from __future__ import annotations

from fastapi import Request

from gateway.audio.common import voice_registry
from gateway.audio.voices import RegisteredVoice


def resolve_chat_voice(request: Request, name: str | None) -> RegisteredVoice | None:
    """The registered voice ``audio.voice`` names (as the request parser read it); None for none,
    ``default`` or an OpenAI built-in name; a 400 (param ``audio.voice``) for an unknown name."""
    if name is None:
        return None
    return voice_registry(request).resolve(name, "audio.voice")
