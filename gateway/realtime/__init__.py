"""Realtime full-duplex WebSocket (docs/protocol.md, Realtime): protocol, session state machine, journal,
routes.

:func:`mount_realtime` is the hook the gateway's app factory calls. Deployment knobs come from
``app.state.realtime_settings`` (a :class:`RealtimeSettings`) when set before the app starts, else the
defaults of docs/protocol.md with the served model name of the gateway config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.realtime.settings import RealtimeSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gateway.realtime.pipeline.events import PipelineHost, SessionPipeline

__all__ = ["RealtimeSettings", "mount_realtime"]


def mount_realtime(app: FastAPI) -> None:
    # Imported here so that importing the package (for RealtimeSettings) does not load FastAPI routes
    # and the stage clients.
    from gateway.realtime.pipeline.duplex import GrpcDuplexPipeline
    from gateway.realtime.routes import create_realtime_router

    settings = getattr(app.state, "realtime_settings", None)
    if settings is None:
        settings = RealtimeSettings()
        config = getattr(app.state, "config", None)
        if config is not None:
            settings.served_model = config.model_name
            settings.max_sessions = config.realtime_session_limit
            settings.first_window_frames = config.profile.stage("talker").codec.first_window_frames
        voices = getattr(app.state, "voices", None)
        if voices is not None:
            settings.voice_lookup = voices.realtime_voice
        app.state.realtime_settings = settings

    def pipeline_factory(session: PipelineHost) -> SessionPipeline:
        # Unit tests of the lifecycle projection may install their own pipeline; the server never does.
        override = getattr(app.state, "realtime_pipeline_factory", None)
        if override is not None:
            pipeline: SessionPipeline = override(session)
            return pipeline
        # Stage channels live on the runtime the app builds in its lifespan (shared with chat routes).
        return GrpcDuplexPipeline(session, app.state.runtime.stages, app.state.realtime_settings)

    router = create_realtime_router(settings, pipeline_factory)
    app.state.realtime = router.realtime  # type: ignore[attr-defined]
    app.include_router(router)
