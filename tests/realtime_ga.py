"""Server events checked against the stock ``openai`` SDK's GA realtime models (openai.types.realtime).

``ga_problems(event)`` validates one event with the SDK's pydantic model for its ``type``
(``model_validate``: a real validation, unlike the SDK's own lenient parsing) and lists what does not fit:
validation errors, and extra keys that are not one of the dialect's documented extensions
(docs/realtime.md, Stock OpenAI Realtime (GA) clients). Events GA does not define (``response.listen``,
``overlap.decision``, …) are the dialect's own and have no model to meet.
"""

from __future__ import annotations

import typing
from typing import Any

# Extra keys the dialect adds to GA events (docs/realtime.md and docs/protocol.md name each one), by the
# GA model class that receives them. Anything else extra is a finding.
DIALECT_EXTRAS: dict[str, frozenset[str]] = {
    "*": frozenset({"server_event_seq", "session_id", "epoch", "metadata", "event"}),
    "ResponseAudioDeltaEvent": frozenset({"format", "sample_rate_hz"}),
    "ResponseCreatedEvent": frozenset({"response_id"}),
    "ResponseDoneEvent": frozenset({"response_id"}),
    "RealtimeResponse": frozenset({"modalities"}),
    "RateLimitsUpdatedEvent": frozenset(),
    "OutputAudioBufferCleared": frozenset({"response_id"}),
    "InputAudioBufferClearedEvent": frozenset(),
    # session.created / session.updated: the dialect's session keys next to GA's
    "SessionCreatedEvent": frozenset({"resume_token", "attachment_generation", "capabilities"}),
    "RealtimeSessionCreateRequest": frozenset(
        {
            "modalities",
            "voice",
            "input_audio_format",
            "output_audio_format",
            "turn_detection",
            "temperature",
            "max_response_output_tokens",
            "idle_timeout_s",
            "overlap_policy",
            "playback_commit_policy",
            "extra_body",
            "id",
            "object",
            "expires_at",
            "resume_token",
            "attachment_generation",
            "capabilities",
            "session_id",
            "state",
            "turn_state",
            "turn_id",
            "active_response_id",
            "playback",
        }
    ),
    "RealtimeAudioConfigInput": frozenset({"sample_rate_hz"}),
    "RealtimeErrorEvent": frozenset(),
    "RealtimeError": frozenset({"retryable"}),
    "InputAudioBufferCommittedEvent": frozenset(),
    "ConversationItemDone": frozenset(),
    "RealtimeConversationItemUserMessage": frozenset(),
    "RealtimeConversationItemAssistantMessage": frozenset(),
    "Content": frozenset({"audio_ms", "format", "sample_rate_hz"}),
}


def _ga_models() -> dict[str, Any]:
    from openai.types.realtime import RealtimeServerEvent

    union = typing.get_args(RealtimeServerEvent)[0]
    out: dict[str, Any] = {}
    for cls in typing.get_args(union):
        for literal in typing.get_args(cls.model_fields["type"].annotation):
            out[literal] = cls
    return out


_MODELS: dict[str, Any] | None = None


def ga_model(event_type: str) -> Any | None:
    """The SDK's GA model of ``event_type``, or None for an event GA does not define."""
    global _MODELS
    if _MODELS is None:
        _MODELS = _ga_models()
    return _MODELS.get(event_type)


def _extras(obj: Any, path: str, found: list[str]) -> None:
    from pydantic import BaseModel

    if isinstance(obj, BaseModel):
        allowed = DIALECT_EXTRAS["*"] | DIALECT_EXTRAS.get(type(obj).__name__, frozenset())
        for key in obj.model_extra or {}:
            if key not in allowed:
                found.append(f"extra {path}.{key} on {type(obj).__name__}")
        for name in type(obj).model_fields:
            _extras(getattr(obj, name), f"{path}.{name}", found)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            _extras(item, f"{path}[{i}]", found)


# Values the dialect keeps where GA's closed sets differ (docs/realtime.md, "What still differs"): the
# docs/protocol.md, "Invariants" B2/B3 name these cancel reasons and the cancelled item status, and a failed
# response keeps its stable code as ``reason`` next to GA's ``error`` object. They are mapped to their GA
# counterparts before validation; nothing else is.
_GA_CANCEL_REASON = {"barge_in": "client_cancelled", "output_audio_buffer_clear": "client_cancelled"}


def _item_to_ga(item: Any) -> Any:
    if isinstance(item, dict) and item.get("status") == "cancelled":
        return {**item, "status": "incomplete"}
    return item


def to_ga(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` with the dialect's documented closed-set values replaced by GA's (see above)."""
    out = dict(event)
    if "item" in out:
        out["item"] = _item_to_ga(out["item"])
    response = out.get("response")
    if isinstance(response, dict):
        response = {**response, "output": [_item_to_ga(i) for i in response.get("output") or []]}
        details = response.get("status_details")
        if isinstance(details, dict):
            details = dict(details)
            if details.get("type") == "cancelled":
                details["reason"] = _GA_CANCEL_REASON.get(details.get("reason"), details.get("reason"))
            if details.get("type") == "failed":
                details.pop("reason", None)
            response["status_details"] = details
        out["response"] = response
    return out


def ga_problems(event: dict[str, Any]) -> list[str]:
    """Validation errors and undocumented extra keys of ``event`` under its GA model ([] when it fits)."""
    from pydantic import ValidationError

    model = ga_model(event["type"])
    if model is None:
        return []
    try:
        parsed = model.model_validate(to_ga(event))
    except ValidationError as exc:
        return [
            f"{event['type']}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']} ({err.get('input')!r})"[
                :300
            ]
            for err in exc.errors()
        ]
    found: list[str] = []
    _extras(parsed, event["type"], found)
    return found
