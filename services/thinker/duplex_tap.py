"""Recording taps for the duplex fidelity dump: what the serving path feeds, computes and decides.

The taps wrap the objects a duplex session already uses (the engine's model runner, the duplex policy's
two decision functions, the model's encoders and embedding merge) for the duration of a ``with`` block and
change nothing they compute, except that :class:`PolicyTap` can *teacher-force* the policy: it then
returns the reference's ids instead of its own choice (recording that choice), so every later row stays
comparable when precision or a near-tie would otherwise make the sessions diverge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from services.thinker import duplex_policy
from services.thinker.duplex_policy import CHUNK_EOS


def _keep(x: torch.Tensor) -> torch.Tensor:
    """An fp32 host copy (a graph replay's output buffers are overwritten by the next replay)."""
    return x.detach().to("cpu", torch.float32, copy=True)


def _top2(x: torch.Tensor) -> tuple[int, float]:
    """(argmax, top1 - top2) of a logit row, in fp32."""
    v, i = x.detach().reshape(-1).float().topk(2)
    return int(i[0]), float(v[0] - v[1])


@dataclass
class RowRecord:
    """Everything the runner fed, by position (one duplex session: the position is the session row)."""

    ids: dict[int, int] = field(default_factory=dict)
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # absent where a graph replay hid it
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # rows whose next token was drawn
    last_sampled: int = -1  # position of the newest row with logits


class RunnerTap:
    """Wraps ``engine.runner.step``: records ids, input rows, final-norm hidden and logits per position.

    Hidden rows come from the packed-row output of a graph replay when the runner exposes it
    (``_row_output``), else from a forward hook on the final norm (eager steps), else only the decode rows.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.rec = RowRecord()
        self._norm_out: torch.Tensor | None = None
        self._packed_hidden: torch.Tensor | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[RowRecord]:
        runner = self.runner
        orig_step = runner.step
        orig_row_output = getattr(runner, "_row_output", None)

        def norm_hook(_m: Any, _args: Any, out: torch.Tensor) -> None:
            self._norm_out = out

        def row_output(inp: Any, hidden: torch.Tensor, logits: torch.Tensor, **kw: Any) -> Any:
            self._packed_hidden = hidden
            return orig_row_output(inp, hidden, logits, **kw)  # type: ignore[misc]

        def step(inp: Any) -> Any:
            self._norm_out = self._packed_hidden = None
            out = orig_step(inp)
            self._record(inp, out)
            return out

        hook = runner.model.norm.register_forward_hook(norm_hook)
        runner.step = step
        if orig_row_output is not None:
            runner._row_output = row_output
        try:
            yield self.rec
        finally:
            hook.remove()
            runner.__dict__.pop("step", None)
            runner.__dict__.pop("_row_output", None)

    def _record(self, inp: Any, out: Any) -> None:
        rows: list[tuple[int, int, torch.Tensor | None]] = [
            (r.position, r.token_id, None) for r in inp.decode
        ]
        for chunk in inp.prefill:
            for i, tok in enumerate(chunk.token_ids):
                emb = chunk.embeds[i] if chunk.embeds is not None and i < chunk.embeds.shape[0] else None
                rows.append((chunk.start + i, tok, emb))
        n = len(rows)
        packed = self._packed_hidden
        if packed is None and self._norm_out is not None and self._norm_out.shape[0] == n:
            packed = self._norm_out
        embed = self.runner.model.embed_tokens
        with torch.inference_mode():
            for j, (pos, tok, emb) in enumerate(rows):
                if pos in self.rec.ids:
                    raise RuntimeError(f"duplex tap: position {pos} fed twice")
                self.rec.ids[pos] = int(tok)
                if emb is None:
                    emb = embed(torch.tensor([tok], device=embed.weight.device))[0]
                self.rec.embeds[pos] = _keep(emb)
                if packed is not None:
                    self.rec.hidden[pos] = _keep(packed[j])
                elif j < len(inp.decode):
                    self.rec.hidden[pos] = _keep(out.decode_hidden[j])
            for j, r in enumerate(inp.decode):
                self.rec.logits[r.position] = _keep(out.decode_logits[j])
                self.rec.last_sampled = r.position
            for chunk, lg in zip(inp.prefill, out.prefill_logits, strict=True):
                if lg is not None:
                    pos = chunk.start + len(chunk.token_ids) - 1
                    self.rec.logits[pos] = _keep(lg)
                    self.rec.last_sampled = pos


@dataclass
class DecodeRecord:
    """One policy draw: the row it read, what it returned, the raw and processed top-2."""

    row: int
    token: int  # what the policy's draw returned (the reference's id when teacher-forced)
    own: int  # what our policy chose on its own
    raw_argmax: int
    raw_margin: float
    margin: float  # of the logits whose argmax gave ``own``


class PolicyTap:
    """Wraps ``duplex_policy._policy_tokens`` and ``policy_logits`` (greedy, one session)."""

    def __init__(self, rows: RowRecord) -> None:
        self.rows = rows
        self.decodes: list[DecodeRecord] = []
        self.forced: list[int] | None = None  # teacher forcing: ids to return, consumed in order
        self._processed: torch.Tensor | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[PolicyTap]:
        orig_tokens = duplex_policy._policy_tokens
        orig_logits = duplex_policy.policy_logits

        def policy_logits(*a: Any, **k: Any) -> torch.Tensor:
            out = orig_logits(*a, **k)
            self._processed = out
            return out

        def policy_tokens(policies: Any, logits: torch.Tensor, num_generated: Any) -> list[int]:
            if logits.shape[0] != 1:
                raise RuntimeError("duplex tap: one session at a time")
            self._processed = None
            tokens = orig_tokens(policies, logits, num_generated)
            raw_top, raw_margin = _top2(logits[0])
            own = tokens[0]
            if own == CHUNK_EOS and raw_top == CHUNK_EOS or self._processed is None:
                margin = raw_margin
            else:
                margin = _top2(self._processed[0])[1]
            token = own
            if self.forced is not None:
                if not self.forced:
                    raise RuntimeError("duplex tap: the reference has no id left for this unit")
                token = self.forced.pop(0)
            self.decodes.append(DecodeRecord(self.rows.last_sampled, token, own, raw_top, raw_margin, margin))
            return [token]

        duplex_policy._policy_tokens = policy_tokens
        duplex_policy.policy_logits = policy_logits
        try:
            yield self
        finally:
            duplex_policy._policy_tokens = orig_tokens
            duplex_policy.policy_logits = orig_logits


@dataclass
class EncoderRecord:
    ref_audio: list[dict[str, torch.Tensor]] = field(default_factory=list)
    audio: list[dict[str, Any]] = field(default_factory=list)
    vision: list[dict[str, Any]] = field(default_factory=list)
    merges: list[dict[str, torch.Tensor]] = field(default_factory=list)


@contextlib.contextmanager
def encoder_tap(model: Any) -> Iterator[EncoderRecord]:
    """Records the encoders' inputs and outputs and each embedding merge's spans (instance wrappers)."""
    rec = EncoderRecord()
    o_aud, o_aud_s = model.get_audio_embeds, model.get_audio_embeds_streaming_batch
    o_vis, o_merge = model.get_vision_embeds, model.merge_embeddings

    def get_audio_embeds(features: torch.Tensor, lens: Any, *a: Any, **k: Any) -> list[torch.Tensor]:
        rows = o_aud(features, lens, *a, **k)
        rec.ref_audio.append(
            {
                "features": _keep(features),
                "lens": torch.as_tensor(lens).reshape(-1).cpu(),
                "rows": _keep(torch.cat(list(rows), 0)),
            }
        )
        return rows

    def get_audio_embeds_streaming_batch(pieces: Any) -> torch.Tensor:
        rows = o_aud_s(pieces)
        for piece, piece_rows in zip(pieces, rows, strict=True):
            parts = [p for p in (piece.lookbehind, piece.mel, piece.lookahead) if p is not None]
            rec.audio.append(
                {
                    "features": _keep(torch.cat([p.float().cpu() for p in parts], -1)),
                    "rows": _keep(piece_rows),
                    "whisper_frames": int(piece.state.frames),
                }
            )
        return rows

    def get_vision_embeds(pixel_values: list[torch.Tensor], tgt_sizes: torch.Tensor) -> torch.Tensor:
        out = o_vis(pixel_values, tgt_sizes)
        rec.vision.append(
            {
                "pixel_values": [_keep(p) for p in pixel_values],
                "tgt_sizes": tgt_sizes.cpu(),
                "embeds": _keep(out),
            }
        )
        return out

    def merge_embeddings(
        ids: torch.Tensor,
        vision: Any = None,
        image_bounds: Any = None,
        audio: Any = None,
        audio_bounds: Any = None,
    ) -> torch.Tensor:
        rec.merges.append(
            {
                "len": torch.tensor(int(ids.numel())),
                "image_bounds": torch.zeros(0, 2, dtype=torch.long)
                if image_bounds is None
                else image_bounds.cpu(),
                "audio_bounds": torch.zeros(0, 2, dtype=torch.long)
                if audio_bounds is None
                else audio_bounds.cpu(),
            }
        )
        return o_merge(ids, vision, image_bounds, audio, audio_bounds)

    model.get_audio_embeds, model.get_audio_embeds_streaming_batch = (
        get_audio_embeds,
        get_audio_embeds_streaming_batch,
    )
    model.get_vision_embeds, model.merge_embeddings = get_vision_embeds, merge_embeddings
    try:
        yield rec
    finally:
        for name in (
            "get_audio_embeds",
            "get_audio_embeds_streaming_batch",
            "get_vision_embeds",
            "merge_embeddings",
        ):
            model.__dict__.pop(name, None)
