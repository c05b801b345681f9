"""The ``basic`` sliding context window of a duplex session (docs/model.md, Duplex context window).

A duplex session grows 13 tokens per listened second, up to 19 more per spoken unit and 66–264 per video
frame, so even the 40,960-token thinker context fills after 52 minutes of audio, or 2.5–8.6 minutes with
video. Without a window the session then ends with ``context_length_exceeded`` (vLLM-Omni's default).
With the window (``--duplex-window basic``), when the next unit would pass ``high`` tokens the session
keeps its prefix (system instructions, reference voice) and the newest whole units that fit in ``low``,
and re-prefills exactly those rows into a fresh sequence at new positions; the conversation then goes on.

The re-prefill must reproduce the rows the model saw: unit inputs carry audio/vision embeddings that
are not token embeddings, so every work item fed with embeddings is recorded here by position (the rows
stay where they are, on the device: about 5% of what the session's KV holds); generated tokens are plain
token embeddings and are rebuilt from their ids. Whole units are
kept or dropped, never split, so a kept unit still starts with the terminator the previous unit left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.errors import INVALID_ARGUMENT, StageError
from services.thinker.duplex_policy import MAX_TOKENS_PER_UNIT
from services.thinker.scheduler import WorkItem

# A duplex session is admitted only if its share of the KV pool holds its prefix and this many tokens more
# (about eight spoken units: their audio rows, markers and replies), so it can go on between trims.
MIN_ROOM_TOKENS = 256


@dataclass(frozen=True)
class DuplexWindow:
    """Trim to at most ``low`` tokens when the next unit could pass ``high`` (HF: 4000 / 3500)."""

    high: int = 8000
    low: int = 6000

    def validate(self, max_context: int) -> DuplexWindow:
        if not 0 < self.low < self.high:
            raise StageError(
                INVALID_ARGUMENT, f"duplex window: need 0 < low ({self.low}) < high ({self.high})"
            )
        if self.high > max_context:
            raise StageError(
                INVALID_ARGUMENT,
                f"duplex window: high ({self.high}) exceeds the thinker context ({max_context})",
            )
        return self

    def within(self, tokens: int) -> DuplexWindow:
        """This window, lowered to at most ``tokens`` (the session's share of the thinker's KV pool,
        :meth:`~services.thinker.engine.ThinkerEngine.session_share`) with ``low`` in the same
        proportion to ``high``; unchanged when the share is larger."""
        if tokens >= self.high:
            return self
        high = max(2, tokens)
        return DuplexWindow(high=high, low=max(1, high * self.low // self.high))


@dataclass
class ContextRecord:
    """What one session fed into its KV with embedding overrides, so that a trim can rebuild its rows."""

    window: DuplexWindow
    embed_tokens: torch.nn.Embedding  # the LLM's token embedding
    prefix_len: int = 0
    unit_starts: list[int] = field(default_factory=list)  # context position where each kept unit began
    overrides: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, [n, H] rows)
    trims: int = 0
    dropped_tokens: int = 0  # fed earlier and trimmed away (usage still counts them)

    def record(self, start: int, work: WorkItem, *, prefix: bool = False) -> None:
        """``work`` is about to be fed at context position ``start``."""
        if prefix:
            self.prefix_len = len(work.token_ids)
        else:
            self.unit_starts.append(start)
        if work.embeds is not None:
            self.overrides.append((start, work.embeds.detach()))

    def needs_trim(self, context: int, incoming: int, window: DuplexWindow | None = None) -> bool:
        """Whether the next unit (``incoming`` tokens) could pass ``window``'s high mark (default: the
        configured window; the caller passes it lowered to the session's share of the KV pool)."""
        return context + incoming + MAX_TOKENS_PER_UNIT > (window or self.window).high

    def trimmed(
        self, tokens: list[int], incoming: int, window: DuplexWindow | None = None
    ) -> WorkItem | None:
        """The prefill that replaces the context ``tokens`` (prefix + newest whole units within ``window``'s
        ``low``, leaving room for the ``incoming`` unit), or None when not even one unit can be dropped."""
        budget = (window or self.window).low - incoming - MAX_TOKENS_PER_UNIT
        cut = len(tokens)
        for start in reversed(self.unit_starts):
            if self.prefix_len + len(tokens) - start > budget:
                break
            cut = start
        if not self.unit_starts or cut <= self.unit_starts[0]:
            return None  # nothing to drop: the caller's context check decides
        kept = tokens[: self.prefix_len] + tokens[cut:]
        with torch.inference_mode():
            ids = torch.tensor(kept, dtype=torch.long)
            rows = self.embed_tokens(ids.to(self.embed_tokens.weight.device))
            overrides: list[tuple[int, torch.Tensor]] = []
            for start, emb in self.overrides:
                if start < self.prefix_len:
                    new = start
                elif start >= cut:
                    new = self.prefix_len + start - cut
                else:
                    continue  # a dropped unit
                rows[new : new + emb.shape[0]] = emb.to(device=rows.device, dtype=rows.dtype)
                overrides.append((new, emb))
        self.overrides = overrides
        self.unit_starts = [self.prefix_len + s - cut for s in self.unit_starts if s >= cut]
        self.trims += 1
        self.dropped_tokens += len(tokens) - len(kept)
        return WorkItem(kept, rows, sampler=None)
