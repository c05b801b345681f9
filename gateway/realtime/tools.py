"""Realtime ``tools`` / ``tool_choice`` (session and ``response.create``): validated in GA's flat shape
(``{"type": "function", "name", "description", "parameters"}``), every error naming its exact field
(``session.tools[0].name``, ``response.tool_choice``).

Realtime sessions do not call functions yet (docs/realtime.md, Function tools): the duplex model decodes
in 1 s units and has no constrained tool-call decoding, so a valid, non-empty tool list is refused with
``tools_unsupported`` instead of being accepted and ignored. ``tools: []`` and ``tool_choice`` ``"auto"``
or ``"none"`` without tools are accepted (a stock client's defaults).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.realtime.errors import RealtimeError

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _bad(message: str, param: str) -> RealtimeError:
    return RealtimeError("invalid_value", message, param=param)


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise _bad(
            f"{param} is not a valid JSON Schema: {exc.message[:200]} (at '/{where}')", param
        ) from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise _bad(f"{param} is not a valid JSON Schema: {type(exc).__name__}", param) from None


def validate_tools(raw: Any, prefix: str) -> list[dict[str, Any]]:
    """The function tools of ``raw`` (``prefix`` is ``session`` or ``response``); raises ``RealtimeError``
    naming the first bad field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{prefix}.tools must be a list", f"{prefix}.tools")
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"{prefix}.tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        if tool.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad(f"{where}.name must be a string matching {NAME_RE.pattern}", f"{where}.name")
        if name in seen:
            raise _bad(f"{where}.name: the function {name!r} is declared twice", f"{where}.name")
        seen.add(name)
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise _bad(f"{where}.description must be a string", f"{where}.description")
        if tool.get("parameters") is not None:
            _check_schema(tool["parameters"], f"{where}.parameters")
    return list(raw)


def validate_tool_choice(raw: Any, tools: list[dict[str, Any]], prefix: str) -> None:
    """``tool_choice``: ``auto``, ``none``, ``required`` or ``{"type": "function", "name"}`` naming a tool."""
    param = f"{prefix}.tool_choice"
    if raw is None or raw in ("auto", "none"):
        return
    if raw == "required":
        if not tools:
            raise _bad(f"{param} 'required' needs tools", param)
        return
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise _bad(f"{param} must be 'auto', 'none', 'required' or {{'type': 'function', 'name'}}", param)
    name = raw.get("name")
    if name not in {t.get("name") for t in tools}:
        raise _bad(f"{param} names the function {str(name)[:80]!r}, which the tools do not declare", param)


def check_tools(obj: dict[str, Any], prefix: str) -> None:
    """Validate ``obj``'s tools and tool choice, then refuse a non-empty tool list (no realtime function
    calling yet): an invalid definition is ``invalid_value`` with its field, a valid one
    ``tools_unsupported`` with ``{prefix}.tools``."""
    tools = validate_tools(obj.get("tools"), prefix)
    validate_tool_choice(obj.get("tool_choice"), tools, prefix)
    if tools:
        raise RealtimeError(
            "tools_unsupported",
            "realtime sessions do not call functions yet; use the chat completions route for tools",
            param=f"{prefix}.tools",
        )
