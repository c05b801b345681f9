"""What the audio routes share: the runtime, the model check, stage errors as API errors, the registry."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TypeVar

from fastapi import Request

from gateway import metrics
from gateway.audio.voices import VoiceRegistry
from gateway.openai.errors import APIError, model_not_found
from gateway.runtime import GatewayRuntime
from gateway.stage_failure import StageFailure


def runtime_of(request: Request) -> GatewayRuntime:
    runtime: GatewayRuntime = request.app.state.runtime
    return runtime


def voice_registry(request: Request) -> VoiceRegistry:
    """The app's registry (built once from ``gateway.voice_dir`` of the deploy profile)."""
    registry = getattr(request.app.state, "voices", None)
    if registry is None:
        registry = VoiceRegistry(runtime_of(request).config.profile.gateway.voice_dir)
        request.app.state.voices = registry
    return registry


def check_model(runtime: GatewayRuntime, model: str | None) -> None:
    """404 for a model this server does not serve (as the chat route answers)."""
    served = runtime.config.model_name
    if model is not None and model != served:
        raise model_not_found(model, served)


def stage_api_error(exc: StageFailure) -> APIError:
    metrics.STAGE_ERRORS.labels(exc.stage, exc.code).inc()
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    return APIError(exc.status, exc.message, exc.param, exc.err_type, headers)


def require_stages(runtime: GatewayRuntime, stages: tuple[str, ...]) -> None:
    """503 + Retry-After now when a needed stage is known down (after the input checks)."""
    try:
        runtime.monitor.require(stages)
    except StageFailure as exc:
        raise stage_api_error(exc) from exc


T = TypeVar("T")


async def first_or_release(gen: AsyncGenerator[T, None], runtime: GatewayRuntime, default: T) -> T:
    """The first item of a streamed reply before its 200 is sent (``default`` when it is empty).

    A stage failure becomes its HTTP error and anything else propagates; either way the request's
    admission slot is released and the generator closed, since no response will own them."""
    try:
        return await anext(gen, default)
    except StageFailure as exc:
        runtime.release()
        await gen.aclose()
        raise stage_api_error(exc) from exc
    except BaseException:
        runtime.release()
        await gen.aclose()
        raise
