"""The conversation of one realtime session: its user and assistant items, in order (docs/protocol.md,
Realtime commit and lanes).

Owned by :class:`gateway.realtime.session.DuplexSession`; the command handlers and the response
lifecycle add and remove items only through :class:`Conversation`'s methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.realtime.audio import AudioUnit
from gateway.realtime.events import ResponseState


@dataclass
class UserItem:
    """A committed user turn: its audio units (kept until the turn lane sends them) and what it holds."""

    id: str
    turn_id: int
    audio_ms: int
    units: list[AudioUnit]
    has_speech: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None, "audio_ms": self.audio_ms}],
        }


@dataclass
class FunctionCallItem:
    """A function call the model made (an output item of its response); ``answered`` once the client sent
    its ``function_call_output``."""

    id: str
    call_id: str
    name: str
    arguments: str
    response_id: str
    status: str = "in_progress"  # then "completed", or "incomplete" when the thinker's call cap cut it
    answered: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "function_call",
            "status": self.status,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
        }


@dataclass
class FunctionCallOutputItem:
    """The client's result of a function call (``conversation.item.create``)."""

    id: str
    call_id: str
    output: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "function_call_output",
            "status": "completed",
            "call_id": self.call_id,
            "output": self.output,
        }


# An assistant message item is its response (``ResponseState.item_id``).
Item = UserItem | ResponseState | FunctionCallItem | FunctionCallOutputItem


class Conversation:
    """Items by id, their order, and the last one added (the ``previous_item_id`` of the next)."""

    def __init__(self) -> None:
        self._items: dict[str, Item] = {}
        self._order: list[str] = []
        self._last: str | None = None

    @property
    def items(self) -> Mapping[str, Item]:
        return self._items

    def __len__(self) -> int:
        return len(self._order)

    def add(self, item: Item) -> str | None:
        """Append ``item``; returns the id of the item before it (``previous_item_id``)."""
        item_id = item.item_id if isinstance(item, ResponseState) else item.id
        self._items[item_id] = item
        self._order.append(item_id)
        previous, self._last = self._last, item_id
        return previous

    def get(self, item_id: str) -> Item | None:
        return self._items.get(item_id)

    def delete(self, item_id: str) -> None:
        del self._items[item_id]
        self._order.remove(item_id)

    def find_call(self, call_id: str) -> FunctionCallItem | None:
        """The function call item with ``call_id`` still in the conversation, if any."""
        for item in self._items.values():
            if isinstance(item, FunctionCallItem) and item.call_id == call_id:
                return item
        return None
