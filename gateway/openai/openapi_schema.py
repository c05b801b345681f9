"""The chat request body as an OpenAPI schema, for ``/openapi.json`` (client generators, schema fuzzers).

The schema is generated from the pydantic models that validate the body
(:class:`gateway.openai.request_models.ChatCompletionRequest`), so the bounds, enums and required fields
published here are the ones requests are held to; the schemathesis run of ``bench/reliability.py fuzz-http``
fuzzes against it. Rules the schema language cannot say (a ``tool_choice`` naming a declared function, a
``tool_call_id`` answering an earlier call, the token budget against the context) are in the field
descriptions.
"""

from __future__ import annotations

from typing import Any

from gateway.openai.request_models import (
    STAGES_SCHEMA,
    ChatCompletionRequest,
    TalkerSampling,
    ThinkerSampling,
)

_REF = "#/components/schemas/{model}"


def chat_request_openapi() -> tuple[dict[str, Any], dict[str, Any]]:
    """(requestBody object, component schemas it refers to) for the chat route's OpenAPI operation."""
    schema = ChatCompletionRequest.model_json_schema(ref_template=_REF, by_alias=True)
    components = schema.pop("$defs", {})
    components["ChatCompletionRequest"] = schema
    # sampling_params_list: position 0 is the thinker's sampling, 1 the talker's, 2 (code2wav) free
    stages = []
    for model in (ThinkerSampling, TalkerSampling):
        components[model.__name__] = model.model_json_schema(ref_template=_REF)
        stages.append({"anyOf": [{"$ref": _REF.format(model=model.__name__)}, {"type": "null"}]})
    spl = schema["properties"]["sampling_params_list"]
    for option in spl.get("anyOf", []):
        if option == STAGES_SCHEMA:
            option["prefixItems"] = [*stages, {}]
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
    }
    return body, components
