"""Token layouts of duplex mode (docs/model.md, Duplex), as id lists with ``<unk>`` rows for embeddings.

The engine feeds these through :meth:`ThinkerModel.merge_embeddings`: ``image_bounds`` spans take the
vision rows (64 per slice, frames in order), ``audio_bounds`` the unit's audio rows.

Per unit: ``[previous terminator] [</unit>] <unit> {frames} {audio rows}``, then the model decodes.
Upstream feeds the unit's terminator and ``</unit>`` right after decoding; an engine that drops the last
sampled token re-injects them at the start of the next unit instead (same sequence). A frame is
``<image>`` 64 ``</image>`` followed by ``<slice>`` 64 ``</slice>`` per HD cell; the audio rows carry no
``<|audio_start|>`` framing. The session prefix is ``<|im_start|>system\\n{instructions}`` [+
``\\n<|audio_start|>`` + reference-voice rows + ``<|audio_end|>``] + ``<|im_end|>``, optionally followed by
a seeded user turn and the assistant header; the two text pieces around the reference rows are
tokenised separately, as upstream does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.common.checkpoint import SPECIAL_TOKEN_IDS
from services.thinker.processor.chat import tool_response_block, tools_block

UNK_ID = SPECIAL_TOKEN_IDS["<unk>"]
UNIT_OPEN = SPECIAL_TOKEN_IDS["<unit>"]
UNIT_CLOSE = SPECIAL_TOKEN_IDS["</unit>"]
DEFAULT_DUPLEX_INSTRUCTIONS = "Streaming Omni Conversation."
AUDIO_ROWS_PER_UNIT = 10


@dataclass
class TokenLayout:
    """Ids with ``<unk>`` where embedding rows go, and the ``[start, end)`` spans of those rows."""

    input_ids: list[int] = field(default_factory=list)
    image_bounds: list[tuple[int, int]] = field(default_factory=list)
    audio_bounds: list[tuple[int, int]] = field(default_factory=list)

    def extend_ids(self, ids: Sequence[int]) -> None:
        self.input_ids.extend(int(i) for i in ids)

    def add_rows(self, count: int, kind: str) -> None:
        start = len(self.input_ids)
        self.input_ids.extend([UNK_ID] * count)
        (self.image_bounds if kind == "image" else self.audio_bounds).append((start, start + count))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [L], image_bounds [n, 2], audio_bounds [m, 2]) as int64 tensors."""
        return (
            torch.tensor(self.input_ids, dtype=torch.long),
            torch.tensor(self.image_bounds, dtype=torch.long).reshape(-1, 2),
            torch.tensor(self.audio_bounds, dtype=torch.long).reshape(-1, 2),
        )


def duplex_unit_layout(
    slices_per_frame: Sequence[int] = (),
    *,
    audio_rows: int = AUDIO_ROWS_PER_UNIT,
    previous_terminator: int | None = None,
    close_previous_unit: bool = False,
    query_num: int = 64,
    note_ids: Sequence[int] = (),
) -> TokenLayout:
    """Prefill layout of one duplex unit.

    ``slices_per_frame`` = slices of each frame (1 = overview only; ``ThinkerProcessor.process_frames``
    returns them). ``previous_terminator`` (e.g. ``<|listen|>``) and ``close_previous_unit`` (``</unit>``)
    re-inject the end of the previous unit when the engine did not feed it after decoding. ``note_ids``
    (a per-response system note, :func:`duplex_note_text`) go between the previous unit and ``<unit>``.
    """
    layout = TokenLayout()
    if previous_terminator is not None:
        layout.extend_ids([previous_terminator])
    if close_previous_unit:
        layout.extend_ids([UNIT_CLOSE])
    layout.extend_ids(note_ids)
    layout.extend_ids([UNIT_OPEN])
    for count in slices_per_frame:
        if count < 1:
            raise ValueError("every frame has at least its overview slice")
        layout.extend_ids([SPECIAL_TOKEN_IDS["<image>"]])
        layout.add_rows(query_num, "image")
        layout.extend_ids([SPECIAL_TOKEN_IDS["</image>"]])
        for _ in range(count - 1):
            layout.extend_ids([SPECIAL_TOKEN_IDS["<slice>"]])
            layout.add_rows(query_num, "image")
            layout.extend_ids([SPECIAL_TOKEN_IDS["</slice>"]])
    if audio_rows:
        layout.add_rows(audio_rows, "audio")
    return layout


def duplex_note_text(instructions: str) -> str:
    """A per-response instruction inside a duplex stream: a system message of the chat template, placed
    between two units (the session prefix is the only system message upstream's duplex prompt has; a note
    between units is this server's extension, docs/realtime.md)."""
    return "<|im_start|>system\n" + instructions + "<|im_end|>\n"


def duplex_tools_note(tools: Sequence[str]) -> str:
    """Function tools offered inside a duplex stream: the chat template's tools system message (the tools
    header, one JSON signature per line, the ``<tool_call>`` format), placed between two units like an
    instructions note (docs/model.md, Duplex tool calls)."""
    return "<|im_start|>system\n" + tools_block(tools)


def duplex_tool_outputs_note(outputs: Sequence[str]) -> str:
    """Function results inside a duplex stream: the chat template's tool message (one user message of
    ``<tool_response>`` blocks), placed between two units."""
    return "<|im_start|>user" + "".join(tool_response_block(o) for o in outputs) + "<|im_end|>\n"


def duplex_session_prefix(
    encode: Callable[[str], list[int]],
    *,
    instructions: str | None = None,
    ref_audio_rows: int = 0,
    seeded_user_text: str | None = None,
) -> TokenLayout:
    """Session prefix of a duplex stream; ``encode`` is ``ThinkerProcessor.encode_text``.

    ``ref_audio_rows`` = embedding count of the reference voice (``ThinkerProcessor.process_audio``);
    0 leaves the voice out.
    """
    layout = TokenLayout()
    head = "<|im_start|>system\n" + (instructions or DEFAULT_DUPLEX_INSTRUCTIONS)
    if ref_audio_rows > 0:
        layout.extend_ids(encode(head + "\n<|audio_start|>"))
        layout.add_rows(ref_audio_rows, "audio")
        tail = "<|audio_end|><|im_end|>"
    else:
        tail = head + "<|im_end|>"
    if seeded_user_text:
        tail += "\n<|im_start|>user\n" + seeded_user_text + "<|im_end|>\n<|im_start|>assistant\n"
    layout.extend_ids(encode(tail))
    return layout
