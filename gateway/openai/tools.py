"""Tool calling and structured outputs for ``/v1/chat/completions``: the request side.

The validated ``tools`` become the thinker's ``tools_json`` (the chat template renders them into the
system prompt) and ``tool_choice`` / ``response_format`` become a grammar constraint (``required`` and a
named function: the model's ``<tool_call>`` blocks, so the arguments always follow the schema;
``json_object`` / ``json_schema``: compact JSON). ``auto`` leaves the model free and parses whatever calls
it writes; ``none`` offers no tools. The format itself, the grammar and the parser of the model's calls
are :mod:`gateway.tool_calls`, which the realtime sessions share.
"""

from __future__ import annotations

import json

from gateway.openai.protocol import ChatRequest
from gateway.tool_calls import call_constraint, forced_tools, signatures
from services.common.pb import thinker_pb2


def tools_json(req: ChatRequest) -> list[str]:
    """The tools as the chat template shows them, one JSON signature each (none for ``tool_choice: none``)."""
    if req.tool_choice.mode == "none":
        return []
    return signatures(req.tools)


def constraint(req: ChatRequest) -> thinker_pb2.Constraint | None:
    """The grammar the thinker enforces for this request, if any."""
    kind = thinker_pb2.Constraint.Kind
    choice = req.tool_choice
    if req.tools and choice.forced:
        parallel = req.parallel_tool_calls and choice.mode == "required"
        return call_constraint(forced_tools(req.tools, choice), parallel=parallel)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return thinker_pb2.Constraint(kind=kind.KIND_JSON_OBJECT)
    return thinker_pb2.Constraint(kind=kind.KIND_JSON_SCHEMA, spec=json.dumps(fmt.schema or {}))


def constraint_param(req: ChatRequest) -> str:
    """The request field a grammar the thinker refuses came from, for the error's ``param``: the forced
    tools' schemas or the response format's schema (the thinker only knows ``sampling.constraint``)."""
    if req.tools and req.tool_choice.forced:
        return "tools"
    fmt = req.response_format
    return (
        "response_format.json_schema.schema"
        if fmt is not None and fmt.type == "json_schema"
        else "response_format"
    )


def parses_tool_calls(req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice.mode != "none"
