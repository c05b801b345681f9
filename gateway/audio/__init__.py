"""OpenAI's audio API on the omni model: ``/v1/audio/speech``, ``/v1/audio/transcriptions``,
``/v1/audio/translations`` and the voice registry ``/v1/audio/voices`` (see docs/audio_api.md).

The multipart routes (voices, transcriptions, translations) need ``python-multipart`` (a dependency in
pyproject.toml); FastAPI refuses to even declare them without it, so an environment that lacks it still
serves chat, realtime and ``/v1/audio/speech`` and logs what is missing instead of failing to start.
"""

from __future__ import annotations

import importlib.util
import logging

from fastapi import APIRouter

from gateway.audio.speech import router as speech_router

log = logging.getLogger(__name__)
router = APIRouter(tags=["audio"])
router.include_router(speech_router)
if importlib.util.find_spec("python_multipart") is not None:
    from gateway.audio.transcribe import router as transcribe_router
    from gateway.audio.voice_routes import router as voice_router

    router.include_router(voice_router)
    router.include_router(transcribe_router)
else:  # pragma: no cover - the project's dependencies include it
    log.warning("python-multipart is not installed: /v1/audio/voices and /v1/audio/transcriptions are off")

__all__ = ["router"]
