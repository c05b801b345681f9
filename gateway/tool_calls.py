"""Function calls in the model's own format, shared by ``/v1/chat/completions`` and the realtime sessions.

Both routes offer tools the same way and read calls back the same way (docs/model.md, "Tool calls"):

* :func:`signatures`: the tools as the chat template shows them (one JSON signature each, sent to the
  thinker as ``tools_json``, which renders them into the template's tools system message);
* :func:`call_constraint`: the grammar of the model's ``<tool_call>`` blocks over some tools
  (``KIND_TOOL_CALLS``): what the thinker enforces for ``tool_choice`` required or a named function, so
  the arguments always follow the schema whatever the weights;
* :class:`ToolCallParser`: the generated text split into its text part and its ``<tool_call>`` blocks,
  incrementally (a stream sends a call's id and name first and its argument fragments after).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.pb import thinker_pb2

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# The start of a block in the model's format, up to where the arguments begin.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolSpec:
    """A declared ``{"type": "function"}`` tool; ``parameters`` is a checked JSON Schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False


@dataclass
class ToolChoice:
    """``tool_choice`` normalised: ``mode`` "function" carries the forced function's ``name``."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """``required`` or a named function: the model must call (a grammar makes it)."""
        return self.mode in ("required", "function")


def signatures(tools: Sequence[ToolSpec]) -> list[str]:
    """One JSON signature per tool (``{"type": "function", "function": {...}}``), as the template shows them."""
    out = []
    for tool in tools:
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = tool.parameters
        out.append(json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
    return out


def call_constraint(tools: Sequence[ToolSpec], *, parallel: bool) -> thinker_pb2.Constraint:
    """The grammar of ``<tool_call>`` blocks calling one of ``tools`` (``parallel``: one or more blocks)."""
    spec = [{"name": t.name, "parameters": t.parameters} for t in tools]
    kind = thinker_pb2.Constraint.Kind.KIND_TOOL_CALLS
    return thinker_pb2.Constraint(kind=kind, spec=json.dumps(spec), parallel=parallel)


def forced_tools(tools: Sequence[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    """The tools a forced ``tool_choice`` allows: all of them (``required``) or the named one."""
    return [t for t in tools if choice.mode == "required" or t.name == choice.name]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class _Call:
    index: int
    id: str
    name: str | None = None
    args_sent: int = 0  # characters of the arguments already streamed


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallParser:
    """Incremental split of generated text into the text part and tool calls.

    :meth:`feed` takes a text delta and returns what can be shown now: text (a possible partial
    ``<tool_call>`` is held back) and ``delta.tool_calls`` entries; :meth:`finish` flushes the rest.
    A block that does not parse as a call is given back as text (``auto`` on a confused model).
    """

    pending: str = ""
    block: str | None = None  # text inside the open block
    calls: list[ParsedCall] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    _current: _Call | None = None
    _count: int = 0
    _fallback: str = ""  # a closed block that was no call: shown as text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += delta
        shown: list[str] = []
        calls: list[dict[str, Any]] = []
        while self.pending:
            if self.block is None:
                at = self.pending.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_suffix(self.pending, OPEN_TAG)
                    shown.append(self._outside(self.pending[: len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                shown.append(self._outside(self.pending[:at]))
                self.pending = self.pending[at + len(OPEN_TAG) :]
                self.block = ""
                self._current = _Call(self._count, new_call_id())
                continue
            end = self.pending.find(CLOSE_TAG)
            if end < 0:
                keep = _partial_suffix(self.pending, CLOSE_TAG)
                self.block += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                calls.extend(self._stream_call(final=False))
                break
            self.block += self.pending[:end]
            self.pending = self.pending[end + len(CLOSE_TAG) :]
            calls.extend(self._stream_call(final=True))
            shown.append(self._fallback)
            self._fallback = ""
        text = "".join(shown)
        self.text_parts.append(text)
        return text, calls

    def _outside(self, text: str) -> str:
        """Text outside the blocks; whitespace after a call is layout between blocks, not content."""
        return "" if self.calls and not text.strip() else text

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """End of output: an unclosed block is closed if it parses, else given back as text."""
        if self.block is not None:
            self.block += self.pending
            self.pending = ""
            calls = self._stream_call(final=True, closed=False)
            text, self._fallback = self._fallback, ""
            self.text_parts.append(text)
            return text, calls
        text, self.pending = self.pending, ""
        self.text_parts.append(text)
        return text, []

    def _stream_call(self, *, final: bool, closed: bool = True) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries the open block allows now; ``final`` ends the block (at its
        ``</tool_call>``, or unclosed at the end of the output: ``closed`` False)."""
        cur = self._current
        assert cur is not None and self.block is not None
        out: list[dict[str, Any]] = []
        head = _HEAD.match(self.block)
        if cur.name is None and head is not None:
            cur.name = json.loads(f'"{head.group(1)}"')
            out.append(
                {
                    "index": cur.index,
                    "id": cur.id,
                    "type": "function",
                    "function": {"name": cur.name, "arguments": ""},
                }
            )
        if head is not None:
            args = self.block[head.end() :]
            if final:
                args = args.rstrip()
                args = args[:-1].rstrip() if args.endswith("}") else args
            else:
                # Hold back what may be the block's closing brace and layout.
                stripped = args.rstrip()
                args = stripped[:-1] if stripped.endswith("}") else stripped
            if len(args) > cur.args_sent:
                out.append({"index": cur.index, "function": {"arguments": args[cur.args_sent :]}})
                cur.args_sent = len(args)
        if not final:
            return out
        block, self.block, self._current = self.block, None, None
        if cur.name is None or head is None:
            parsed = _loose_call(block)
            if parsed is None:
                # Given back as generated: a block cut by max_tokens has no closing tag to show.
                self._fallback = OPEN_TAG + block + (CLOSE_TAG if closed else "")
                return out
            cur.name, arguments = parsed
            out.append(
                {
                    "index": cur.index,
                    "id": cur.id,
                    "type": "function",
                    "function": {"name": cur.name, "arguments": arguments},
                }
            )
        else:
            arguments = self.block_args(block, head)
        self.calls.append(ParsedCall(cur.id, cur.name, arguments))
        self._count += 1
        return out

    @staticmethod
    def block_args(block: str, head: re.Match[str]) -> str:
        args = block[head.end() :].rstrip()
        return args[:-1].rstrip() if args.endswith("}") else args


def _loose_call(block: str) -> tuple[str, str] | None:
    """A block in any key order: ``{"name": ..., "arguments": {...}}`` parsed as JSON."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def parse_all(text: str) -> tuple[str, list[ParsedCall]]:
    """Whole-output split: the text part (stripped when calls were made) and the calls."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    content = parser.text
    return (content.strip() if parser.calls else content), parser.calls
