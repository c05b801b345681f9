"""Whisper audio encoder with MiniCPM-o's 1 s chunked attention, the audio projector and the pooling.

Rates (docs/model.md, Thinker inputs): 100 mel frames/s -> conv stride 2 -> 50 encoder frames/s -> projector
-> AvgPool(``pool_step`` = 5) -> 10 embeddings/s.

Attention is *chunked*: an encoder frame sees every frame of its own 1 s chunk and of all earlier chunks,
never a later chunk. That is what makes the encoder streamable: encoding a clip in one call
(:meth:`WhisperChunkedEncoder.forward`) and encoding it one chunk at a time with a key/value cache
(:class:`AudioStreamState` + :meth:`WhisperChunkedEncoder.forward_chunk`) give the same rows, as long as
each streamed chunk is a whole number of chunks and the convolution sees its left context.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, cast, overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from services.common.device import to_device
from services.common.sdpa import attention
from services.thinker.model.config import AudioDims

log = logging.getLogger(__name__)

ENCODER_FRAMES_PER_SECOND = 50


@overload
def conv_output_length(mel_frames: torch.Tensor) -> torch.Tensor: ...
@overload
def conv_output_length(mel_frames: int) -> int: ...
def conv_output_length(mel_frames: torch.Tensor | int) -> torch.Tensor | int:
    """Encoder frames produced by ``mel_frames`` mel frames (conv2 has stride 2, padding 1)."""
    return (mel_frames - 1) // 2 + 1


@overload
def pooled_length(mel_frames: torch.Tensor, pool_step: int) -> torch.Tensor: ...
@overload
def pooled_length(mel_frames: int, pool_step: int) -> int: ...
def pooled_length(mel_frames: torch.Tensor | int, pool_step: int) -> torch.Tensor | int:
    """Audio embeddings produced by ``mel_frames`` mel frames after the stride-``pool_step`` pooling."""
    return (conv_output_length(mel_frames) - pool_step) // pool_step + 1


def chunked_attention_allowed(
    length: int, chunk_frames: int, device: torch.device | None = None
) -> torch.Tensor:
    """``[length, length]`` bool: query i may attend key j iff j lies in i's chunk or an earlier one."""
    idx = torch.arange(length, device=device)
    chunk_end = torch.clamp((idx // chunk_frames + 1) * chunk_frames, max=length)
    return idx[None, :] < chunk_end[:, None]


class WhisperAttention(nn.Module):
    def __init__(self, dims: AudioDims) -> None:
        super().__init__()
        d = dims.d_model
        self.num_heads = dims.num_heads
        self.head_dim = d // dims.num_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Self-attention over a whole clip ``x`` [B, T, d] under ``mask`` (the offline encoder)."""
        b, n, d = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        out = attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))

    def forward_streams(self, x: torch.Tensor, cache: StreamCacheView) -> torch.Tensor:
        """``x`` [B, n, d]: row b is the next piece of stream b, whose keys and values are slot
        ``cache.slots[b]`` of this layer's pooled cache, filled up to the piece's first frame ``start``.

        The piece's keys and values are written at ``[start, start + n)`` (``cache.frames``) with one
        ``index_put`` each, and the queries attend over ``[0, start + n)`` in one attention call: the
        caches are gathered up to the longest stream's end, and a stream's keys past its own end are
        masked. Per-stream calls (three launches per stream per layer) made this pass host-bound.
        """
        b, n, d = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        keys, values = cache.layer
        rows = cache.slots[:, None]
        keys[rows, :, cache.frames] = k.transpose(1, 2)  # [B, n, heads, head_dim] into [slot, :, frame]
        values[rows, :, cache.frames] = v.transpose(1, 2)
        out = attention(
            q,
            keys[:, :, : cache.span].index_select(0, cache.slots),
            values[:, :, : cache.span].index_select(0, cache.slots),
            attn_mask=cache.key_mask,
        )
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, dims: AudioDims) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(dims.d_model)
        self.self_attn = WhisperAttention(dims)
        self.final_layer_norm = nn.LayerNorm(dims.d_model)
        self.fc1 = nn.Linear(dims.d_model, dims.ffn_dim)
        self.fc2 = nn.Linear(dims.ffn_dim, dims.d_model)
        self.act = ACT2FN[dims.activation]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))

    def forward_streams(self, x: torch.Tensor, cache: StreamCacheView) -> torch.Tensor:
        """One layer for B streams' next pieces at once (see :meth:`WhisperAttention.forward_streams`)."""
        x = x + self.self_attn.forward_streams(self.self_attn_layer_norm(x), cache)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioCachePool:
    """Every duplex session's Whisper keys and values in one tensor, one slot per session.

    ``tensor`` is ``[slots, layers, 2, heads, max_source_positions, head_dim]``; a slot is exactly what
    the thinker reserves per session
    (:meth:`~services.thinker.model.thinker.ThinkerModel.audio_stream_bytes`, 147 MB at full size). One
    tensor lets a pass over B sessions write every session's new keys and values with one ``index_put``
    per layer and read them with one gather, where separate buffers cost three launches per session per
    layer. It is allocated at the first pass with ``capacity`` slots (the thinker sets that to the
    sequences it reserves for) and doubles, with a warning, if more sessions than that encode at once.

    Passes take :attr:`pass_lock` (one at a time). A session closing during a pass gives its slot back
    through :meth:`release`, which never waits for the pass; the slot is reused only from the next pass
    on (:meth:`begin_pass`), so the running pass may still write it without touching a new session.
    """

    def __init__(self, slot_shape: tuple[int, ...], capacity: int = 4) -> None:
        self.slot_shape = slot_shape
        self.capacity = capacity
        self.tensor: torch.Tensor | None = None
        self.pass_lock = threading.Lock()
        self._free: list[int] = []
        self._released: list[int] = []
        self._release_lock = threading.Lock()  # release runs on the event loop, passes on a worker
        self.scratch: int | None = None  # a slot no session holds (:meth:`take_scratch`)

    @property
    def in_use(self) -> int:
        """Slots held by sessions (or released during the running pass)."""
        if self.tensor is None:
            return 0
        return self.tensor.shape[0] - len(self._free) - (self.scratch is not None)

    def begin_pass(self) -> None:
        """Make the slots released since the last pass free again (call holding :attr:`pass_lock`)."""
        with self._release_lock:
            self._free.extend(self._released)
            self._released.clear()

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """The pooled tensor, allocated with the dtype and device of ``like`` at the first call.

        It starts zeroed: a pass reads every slot's frames up to the longest stream's end (a graphed pass:
        all of them) and masks those past each stream's own end, and a mask does not hide a NaN that
        uninitialised memory may hold (``NaN + -inf`` is NaN in the scores).
        """
        if self.tensor is None:
            self.tensor = torch.zeros((self.capacity, *self.slot_shape), dtype=like.dtype, device=like.device)
            self._free = list(range(self.capacity - 1, -1, -1))
        return self.tensor

    def take_scratch(self, like: torch.Tensor) -> int:
        """A slot kept out of the sessions' use for good, where a graphed pass's padding rows write."""
        if self.scratch is None:
            self.scratch = self.acquire(like)
        return self.scratch

    def acquire(self, like: torch.Tensor) -> int:
        """A free slot (call holding :attr:`pass_lock`); the first call allocates the tensor with the
        dtype and device of ``like``."""
        self.allocate(like)
        assert self.tensor is not None
        if not self._free:
            old = self.tensor
            grown = torch.zeros((2 * old.shape[0], *self.slot_shape), dtype=old.dtype, device=old.device)
            grown[: old.shape[0]] = old
            self.tensor = grown
            self._free = list(range(grown.shape[0] - 1, old.shape[0] - 1, -1))
            log.warning(
                "streaming-Whisper cache grew to %d session slots (%d were reserved for)",
                grown.shape[0],
                self.capacity,
            )
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Give ``slot`` back; it is free again from the next pass on."""
        with self._release_lock:
            self._released.append(slot)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values of every slot, ``[slots, heads, frames, head_dim]`` views."""
        assert self.tensor is not None, "no pass has allocated the cache yet"
        return self.tensor[:, index, 0], self.tensor[:, index, 1]


class StreamGraphs(Protocol):
    """What :meth:`WhisperChunkedEncoder.forward_chunks` asks of a graphed layer stack."""

    def run(self, x: torch.Tensor, slots: Sequence[int], starts: Sequence[int]) -> torch.Tensor | None:
        """The pass's output ``[B, n, d]`` from :meth:`WhisperChunkedEncoder.stream_layers_fixed`'s graph
        for streams at ``starts`` in ``slots``, or None when no graph serves it (the eager path runs)."""
        ...


@dataclass(frozen=True)
class StreamCacheView:
    """Where one pass's B pieces go in the pooled cache (the same for every layer but ``layer``)."""

    slots: torch.Tensor  # [B] each stream's slot
    frames: torch.Tensor  # [B, n] the positions (cache frames and position ids) the piece's n frames take
    span: int  # the longest stream's end after this piece: the keys every stream's attention reads
    key_mask: torch.Tensor | None  # [B, 1, 1, span] keys a stream may see; None when all end at span
    layer: tuple[torch.Tensor, torch.Tensor]  # this layer's keys and values, [slots, heads, frames, hd]

    @classmethod
    def build(
        cls, slots: Sequence[int], starts: Sequence[int], n: int, device: torch.device
    ) -> StreamCacheView:
        ends = [start + n for start in starts]
        span = max(ends)
        starts_t = torch.tensor(starts, dtype=torch.long)
        frames = starts_t[:, None] + torch.arange(n)[None, :]
        mask = None
        if min(ends) != span:
            mask = (torch.arange(span)[None, :] < torch.tensor(ends)[:, None])[:, None, None, :]
            mask = to_device(mask, device)
        empty = torch.empty(0, device=device)
        return cls(
            to_device(torch.tensor(slots, dtype=torch.long), device),
            to_device(frames, device),
            span,
            mask,
            (empty, empty),
        )


@dataclass
class AudioStreamState:
    """Per-session incremental Whisper state (one stream, batch 1).

    The session's keys and values live in slot ``slot`` of its encoder's :class:`AudioCachePool`,
    taken at the stream's first piece and kept until :meth:`release`; frames ``[0, frames)`` are filled.
    ``mel_tail`` holds the last mel frames of the previous piece, which the convolutions need as left
    context.
    """

    pool: AudioCachePool | None = None
    slot: int | None = None
    mel_tail: torch.Tensor | None = None
    frames: int = 0  # encoder frames already in the cache (= next position id)
    released: bool = False  # the session closed: a pass still running uses a slot it does not keep

    @property
    def cache(self) -> torch.Tensor | None:
        """The session's slot, ``[layers, 2, heads, max_source_positions, head_dim]`` (a view), or None."""
        if self.pool is None or self.slot is None or self.pool.tensor is None:
            return None
        return self.pool.tensor[self.slot]

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's cached keys and values, ``[1, heads, frames, head_dim]`` views (tests, dumps)."""
        cache = self.cache
        if cache is None or self.frames == 0:
            return []
        return [(layer[0, None, :, : self.frames], layer[1, None, :, : self.frames]) for layer in cache]

    def reset(self) -> None:
        """Start the stream over at position 0 (the slot is kept for the next frames)."""
        self.mel_tail = None
        self.frames = 0

    def release(self) -> None:
        """Give the slot back now (a closed session), whoever still holds a reference to the state."""
        self.released = True
        self.reset()
        if self.pool is not None and self.slot is not None:
            self.pool.release(self.slot)
        self.slot = None


@dataclass
class StreamPiece:
    """The next piece of one stream for :meth:`WhisperChunkedEncoder.forward_chunks` (see
    :meth:`WhisperChunkedEncoder.forward_chunk` for what ``lookahead`` and ``lookbehind`` mean)."""

    mel: torch.Tensor
    state: AudioStreamState
    lookahead: torch.Tensor | None = None
    lookbehind: torch.Tensor | None = None


class WhisperChunkedEncoder(nn.Module):
    """Whisper encoder (conv front end, learned positions, pre-LN blocks, final LayerNorm)."""

    # Mel frames of left context the two k=3 convolutions need so that streamed pieces match offline
    # (even, so the stride-2 grid stays aligned).
    CONV_LEFT_CONTEXT = 2

    def __init__(self, dims: AudioDims) -> None:
        super().__init__()
        self.dims = dims
        self.conv1 = nn.Conv1d(dims.num_mel_bins, dims.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dims.d_model, dims.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(dims.max_source_positions, dims.d_model)
        self.layers = nn.ModuleList([WhisperEncoderLayer(dims) for _ in range(dims.num_layers)])
        self.layer_norm = nn.LayerNorm(dims.d_model)
        head_dim = dims.d_model // dims.num_heads
        slot = (dims.num_layers, 2, dims.num_heads, dims.max_source_positions, head_dim)
        self.stream_pool = AudioCachePool(slot)  # the duplex sessions' caches (forward_chunks)
        # Replays a pass's layers from a CUDA graph when it can (services.thinker.whisper_graph); None: eager.
        self.stream_graphs: StreamGraphs | None = None

    def _front(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x))
        return x.transpose(1, 2)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor, chunk_frames: int | None) -> torch.Tensor:
        """``mel`` [B, n_mels, T] (zero padded), ``lengths`` [B] mel frames -> [B, conv_len(T), d_model].

        ``chunk_frames`` = encoder frames per attention chunk (50 for 1 s); ``None`` = full attention.
        """
        x = self._front(mel)
        t = x.shape[1]
        if t > self.embed_positions.num_embeddings:
            raise ValueError(
                f"audio piece of {t} encoder frames exceeds the {self.embed_positions.num_embeddings} positions"
            )
        x = x + self.embed_positions.weight[:t]
        valid_keys = (
            torch.arange(t, device=x.device)[None, :] < conv_output_length(lengths.to(x.device))[:, None]
        )
        allowed = valid_keys[:, None, None, :]
        if chunk_frames is not None and chunk_frames > 0:
            allowed = allowed & chunked_attention_allowed(t, chunk_frames, x.device)[None, None]
        for layer in self.layers:
            x = layer(x, allowed)
        return self.layer_norm(x)

    def forward_chunk(
        self,
        mel: torch.Tensor,
        state: AudioStreamState,
        lookahead: torch.Tensor | None = None,
        lookbehind: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode the next piece of one stream: ``mel`` [n_mels, P] with P even (100 for a 1 s unit).

        Inside the piece attention is full and every cached frame is visible, so one call per attention
        chunk reproduces the offline chunked encoder. The convolutions look one mel frame past the piece:
        pass that frame (or more) as ``lookahead`` to match offline exactly; ``None`` zero-pads, which is
        exact only at the true end of the audio. ``lookbehind`` (an even number of frames, possibly 0)
        replaces the previous piece's last frames as left context: the duplex front end recomputes them
        with the current unit's floor, as upstream does. Returns ``[P // 2, d_model]``; ``state`` is updated.
        """
        return self.forward_chunks([StreamPiece(mel, state, lookahead, lookbehind)])[0]

    def forward_chunks(self, pieces: Sequence[StreamPiece]) -> torch.Tensor:
        """Encode the next piece of several streams in one pass: ``[B, P // 2, d_model]``, states updated.

        Every piece must have the same length P (a 1 s unit is 100 frames). The convolutions run once per
        group of pieces with the same window (a stream's first piece has no left context), the
        projections, MLPs and norms of every layer once for all B rows, and attention once over the
        pooled caches (:meth:`WhisperAttention.forward_streams`). Pieces may be on the host: their
        windows are built there and go to the device in one copy per group. Row b equals
        :meth:`forward_chunk` of piece b alone up to float rounding (the batched sums run in another
        order; bit for bit when B is 1).
        """
        if not pieces:
            raise ValueError("forward_chunks needs at least one piece")
        new_frames = pieces[0].mel.shape[-1] // 2
        if len({id(p.state) for p in pieces}) != len(pieces):
            raise ValueError("a stream's pieces must be encoded one call after another, not together")
        for piece in pieces:  # every piece is checked before any state moves on
            self._check_piece(piece, new_frames)
        x = self._fronts(pieces, new_frames)
        pool = self.stream_pool
        with pool.pass_lock:
            pool.begin_pass()
            slots, scratch = [], []
            for piece in pieces:
                state, slot = piece.state, piece.state.slot
                if slot is None:
                    slot = pool.acquire(x)
                    if state.released:  # closed meanwhile: this pass writes a slot the state does not keep
                        scratch.append(slot)
                    else:
                        state.pool, state.slot = pool, slot
                slots.append(slot)
            try:
                starts = [p.state.frames for p in pieces]
                graphs = self.stream_graphs
                out = None if graphs is None else graphs.run(x, slots, starts)
                if out is None:
                    out = self.stream_layers(x, StreamCacheView.build(slots, starts, new_frames, x.device))
                for piece in pieces:
                    piece.state.frames += new_frames
            finally:
                for slot in scratch:
                    pool.release(slot)
        return out

    def stream_layers(self, x: torch.Tensor, view: StreamCacheView) -> torch.Tensor:
        """The pass after the convolutions: positions, every layer over the pooled caches, the final norm."""
        x = x + self.embed_positions.weight[view.frames]
        for li, layer in enumerate(self.layers):
            x = cast(WhisperEncoderLayer, layer).forward_streams(
                x, replace(view, layer=self.stream_pool.layer(li))
            )
        return self.layer_norm(x)

    def stream_layers_fixed(
        self, x: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`stream_layers` with shapes that do not depend on how far the streams are (a CUDA graph).

        ``x`` [B, n, d], ``slots`` [B], ``frames`` [B, n] (each row's positions), ``key_mask`` [B, 1, 1,
        max_source_positions] (the keys row b may see: ``[0, its end)``). Attention reads every frame of
        the slots and masks those past each row's end, where :meth:`StreamCacheView.build` reads only up to
        the longest row's end: the same scores and weights, with more masked keys.
        """
        empty = torch.empty(0, device=x.device)
        span = self.embed_positions.num_embeddings
        return self.stream_layers(x, StreamCacheView(slots, frames, span, key_mask, (empty, empty)))

    def _check_piece(self, piece: StreamPiece, new_frames: int) -> None:
        if piece.mel.shape[-1] % 2:
            raise ValueError("streamed mel pieces must have an even number of frames (conv stride 2)")
        if piece.mel.shape[-1] != 2 * new_frames:
            raise ValueError("pieces encoded together must have the same number of mel frames")
        if piece.state.frames + new_frames > self.embed_positions.num_embeddings:
            raise ValueError(
                f"audio stream exceeds {self.embed_positions.num_embeddings} encoder positions; reset the state"
            )
        tail = piece.state.mel_tail if piece.lookbehind is None else piece.lookbehind
        if tail is not None and tail.shape[-1] % 2:
            raise ValueError("the left context must have an even number of frames (conv stride 2)")

    def _fronts(self, pieces: Sequence[StreamPiece], new_frames: int) -> torch.Tensor:
        """Every piece through the convolutions: ``[B, P // 2, d_model]``; each state's ``mel_tail`` moves
        on (its slot and frame count move on in :meth:`forward_chunks`).

        A piece's window is its left context (the previous piece's last frames, or ``lookbehind``), the
        piece and up to two lookahead frames. Pieces whose windows have the same shape run as one batch;
        with an even left context the stride-2 grid stays aligned with the offline pass, and the first
        left/2 outputs (the previous piece's) are dropped.
        """
        weight = self.conv1.weight
        groups: dict[tuple[int, int], list[int]] = {}
        windows: list[torch.Tensor] = []
        for i, piece in enumerate(pieces):
            mel, state = piece.mel, piece.state
            parts = [mel]
            tail = state.mel_tail if piece.lookbehind is None else piece.lookbehind
            if tail is not None and tail.shape[-1] > 0:
                parts.insert(0, tail.to(mel.device))
            left = parts[0].shape[-1] if len(parts) > 1 else 0
            if piece.lookahead is not None and piece.lookahead.shape[-1] > 0:
                parts.append(piece.lookahead[:, :2].to(mel.device))
            windows.append(torch.cat(parts, dim=-1) if len(parts) > 1 else mel)
            groups.setdefault((left, windows[-1].shape[-1]), []).append(i)
            state.mel_tail = mel[:, -self.CONV_LEFT_CONTEXT :]
        rows: list[torch.Tensor | None] = [None] * len(pieces)
        for (left, _), members in groups.items():
            batch = to_device(torch.stack([windows[i] for i in members]), weight.device)
            front = self._front(batch)[:, left // 2 : left // 2 + new_frames]
            if len(groups) == 1:
                return front  # every window alike (the steady state): already in the pieces' order
            for row, i in zip(front.unbind(0), members, strict=True):
                rows[i] = row
        return torch.stack(cast(list[torch.Tensor], rows))


class AudioProjector(nn.Module):
    """Linear -> ReLU -> Linear from the encoder width to the LLM width."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


def pool_embeddings(x: torch.Tensor, pool_step: int) -> torch.Tensor:
    """Average consecutive groups of ``pool_step`` frames: [B, T, H] -> [B, T // pool_step, H]."""
    return F.avg_pool1d(x.transpose(1, 2), pool_step, stride=pool_step).transpose(1, 2)
