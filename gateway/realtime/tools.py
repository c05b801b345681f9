"""Realtime function tools (docs/realtime.md, Function tools): ``tools`` / ``tool_choice`` of
``session.update`` and ``response.create``, validated in GA's flat shape (``{"type": "function", "name",
"description", "parameters"}``) with every error naming its exact field (``session.tools[0].name``,
``response.tool_choice``), and the :class:`ToolSet` a model turn runs with.

What the model is offered and how its calls are read is the chat route's (:mod:`gateway.tool_calls`): the
same signatures in the chat template's tools message, the same ``<tool_call>`` grammar for ``required`` /
a named function, the same parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.realtime.errors import RealtimeError
from gateway.tool_calls import ToolChoice, ToolSpec, call_constraint, forced_tools, signatures
from services.common.pb import thinker_pb2

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolSet:
    """The tools a model turn is offered and how it must use them (``tool_choice``)."""

    tools: list[ToolSpec] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=lambda: ToolChoice("auto"))

    @property
    def active(self) -> bool:
        """Tools are offered (some declared, ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def forced(self) -> bool:
        """The turn must be a call (``required`` or a named function)."""
        return self.active and self.choice.forced

    def signatures(self) -> list[str]:
        """The offered tools as the chat template shows them (none when inactive)."""
        return signatures(self.tools) if self.active else []

    def grammar(self) -> thinker_pb2.Constraint | None:
        """The grammar of one call: over the forced tools for a forced choice (the thinker makes the turn that
        call), else over every offered tool (a call the model starts itself is completed under it)."""
        if not self.active:
            return None
        tools = forced_tools(self.tools, self.choice) if self.forced else self.tools
        return call_constraint(tools, parallel=False)

    def render_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the session object echoes them (GA's flat function tools)."""
        out = []
        for t in self.tools:
            tool: dict[str, Any] = {"type": "function", "name": t.name}
            if t.description is not None:
                tool["description"] = t.description
            tool["parameters"] = t.parameters
            out.append(tool)
        return out

    def render_choice(self) -> str | dict[str, str]:
        if self.choice.mode == "function":
            return {"type": "function", "name": self.choice.name or ""}
        return self.choice.mode


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


def validate_tools(raw: Any, prefix: str) -> list[ToolSpec]:
    """The function tools of ``raw`` (``prefix`` is ``session`` or ``response``); raises ``RealtimeError``
    naming the first bad field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{prefix}.tools must be a list", f"{prefix}.tools")
    out: list[ToolSpec] = []
    for i, tool in enumerate(raw):
        where = f"{prefix}.tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        if tool.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad(f"{where}.name must be a string matching {NAME_RE.pattern}", f"{where}.name")
        if any(t.name == name for t in out):
            raise _bad(f"{where}.name: the function {name!r} is declared twice", f"{where}.name")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.description must be a string", f"{where}.description")
        parameters = tool.get("parameters")
        if parameters is not None:
            _check_schema(parameters, f"{where}.parameters")
        out.append(
            ToolSpec(name, description, parameters if parameters is not None else dict(EMPTY_PARAMETERS))
        )
    return out


def validate_tool_choice(raw: Any, tools: list[ToolSpec], prefix: str) -> ToolChoice:
    """``tool_choice``: ``auto`` (also for null), ``none``, ``required`` or ``{"type": "function", "name"}``
    naming a declared tool."""
    param = f"{prefix}.tool_choice"
    if raw is None or raw == "auto":
        return ToolChoice("auto")
    if raw == "none":
        return ToolChoice("none")
    if raw == "required":
        if not tools:
            raise _bad(f"{param} 'required' needs tools", param)
        return ToolChoice("required")
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise _bad(f"{param} must be 'auto', 'none', 'required' or {{'type': 'function', 'name'}}", param)
    name = raw.get("name")
    if not isinstance(name, str) or name not in {t.name for t in tools}:
        raise _bad(f"{param} names the function {str(name)[:80]!r}, which the tools do not declare", param)
    return ToolChoice("function", name)


def parse_tools(obj: dict[str, Any], prefix: str, base: ToolSet) -> ToolSet:
    """The tool set ``obj`` asks for on top of ``base`` (the session's).

    ``session``: ``tools`` and ``tool_choice`` each replace the session's own. ``response``: the response's
    ``tools`` replace the session's for that response (their ``tool_choice`` defaults to ``auto``), a
    ``tool_choice`` alone applies to the session's tools. Either way the choice is checked against the
    tools it will run with.
    """
    if "tools" not in obj and "tool_choice" not in obj:
        return base
    tools = validate_tools(obj["tools"], prefix) if "tools" in obj else base.tools
    if "tool_choice" in obj:
        raw_choice: Any = obj["tool_choice"]
    elif prefix == "session":
        raw_choice = base.render_choice()
    else:
        raw_choice = "auto"
    return ToolSet(tools, validate_tool_choice(raw_choice, tools, prefix))
