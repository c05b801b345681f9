"""OpenAI's audio API on the omni model: ``/v1/audio/speech``, ``/v1/audio/transcriptions``,
``/v1/audio/translations`` and the voice registry ``/v1/audio/voices`` (see docs/audio_api.md)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.audio.speech import router as speech_router
from gateway.audio.transcribe import router as transcribe_router
from gateway.audio.voice_routes import router as voice_router

router = APIRouter(tags=["audio"])
router.include_router(speech_router)
router.include_router(voice_router)
router.include_router(transcribe_router)

__all__ = ["router"]
