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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast, overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from services.common.sdpa import attention
from services.thinker.model.config import AudioDims

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

    def forward_streams(self, x: torch.Tensor, caches: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """``x`` [B, n, d]: row b is the next piece of stream b, whose cache is ``caches[b]``.

        A cache is ``(buffer, start)``: this layer's ``[2, heads, max_frames, head_dim]`` keys and values of
        the stream, filled up to frame ``start``. The piece's keys and values are written at
        ``[start, start + n)`` and its queries attend over ``[0, start + n)``. The projections run once
        for all B streams; attention runs per stream over its own cache (the caches have different
        lengths, and padding them to one length would change the softmax's summation order, so the rows
        would no longer equal a single stream's bit for bit on CPU).
        """
        b, n, d = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        outs: list[torch.Tensor] = []
        for i, (buf, start) in enumerate(caches):
            end = start + n
            buf[0, :, start:end] = k[i]
            buf[1, :, start:end] = v[i]
            outs.append(attention(q[i : i + 1], buf[0, None, :, :end], buf[1, None, :, :end]))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
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

    def forward_streams(self, x: torch.Tensor, caches: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """One layer for B streams' next pieces at once (see :meth:`WhisperAttention.forward_streams`)."""
        x = x + self.self_attn.forward_streams(self.self_attn_layer_norm(x), caches)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


@dataclass
class AudioStreamState:
    """Per-session incremental Whisper state (one stream, batch 1).

    ``cache`` holds every layer's keys and values, ``[layers, 2, heads, max_source_positions, head_dim]``,
    in one buffer allocated at the stream's first piece; frames ``[0, frames)`` are filled. One
    fixed-size buffer per session, rather than per-layer tensors that grow by one piece each unit, means
    no copy of the whole cache per unit and no allocator blocks of ever-changing sizes (with two dozen
    sessions those fragment the thinker's capped memory); its size is exactly what the thinker reserves
    per session (:meth:`~services.thinker.model.thinker.ThinkerModel.audio_stream_bytes`).
    ``mel_tail`` holds the last mel frames of the previous piece, which the convolutions need as left
    context.
    """

    cache: torch.Tensor | None = None
    mel_tail: torch.Tensor | None = None
    frames: int = 0  # encoder frames already in the cache (= next position id)
    released: bool = False  # the session closed: a pass still running gets a buffer it does not keep

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's cached keys and values, ``[1, heads, frames, head_dim]`` views (tests, dumps)."""
        if self.cache is None or self.frames == 0:
            return []
        return [(layer[0, None, :, : self.frames], layer[1, None, :, : self.frames]) for layer in self.cache]

    def reset(self) -> None:
        """Start the stream over at position 0 (the buffer is kept for the next frames)."""
        self.mel_tail = None
        self.frames = 0

    def release(self) -> None:
        """Drop the buffer now (a closed session), whoever still holds a reference to the state."""
        self.released = True
        self.reset()
        self.cache = None


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

        Every piece must have the same length P (a 1 s unit is 100 frames). The convolutions run per
        piece (the first piece of a stream has no left context, so the windows differ in width, and a
        batched convolution does not sum in the same order as a single one); the projections, MLPs and
        norms of every layer run once for all B rows; attention runs per stream over its own cache. Row b
        equals :meth:`forward_chunk` of piece b alone, bit for bit on CPU fp32 (tests hold it to that).
        """
        if not pieces:
            raise ValueError("forward_chunks needs at least one piece")
        new_frames = pieces[0].mel.shape[-1] // 2
        if len({id(p.state) for p in pieces}) != len(pieces):
            raise ValueError("a stream's pieces must be encoded one call after another, not together")
        for piece in pieces:  # every piece is checked before any state moves on
            self._check_piece(piece, new_frames)
        rows = [self._piece_front(piece, new_frames) for piece in pieces]
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        # Buffers and start frames are read once: a session closed meanwhile (release) loses its buffer
        # only after this pass, which still holds it.
        buffers = [self._cache_of(p.state, x) for p in pieces]
        starts = [p.state.frames for p in pieces]
        for li, layer in enumerate(self.layers):
            caches = [(buf[li], start) for buf, start in zip(buffers, starts, strict=True)]
            x = cast(WhisperEncoderLayer, layer).forward_streams(x, caches)
        for piece in pieces:
            piece.state.frames += new_frames
        return self.layer_norm(x)

    def _cache_of(self, state: AudioStreamState, like: torch.Tensor) -> torch.Tensor:
        """The stream's cache buffer, allocated on its first piece (dtype and device of ``like``)."""
        if state.cache is not None:
            return state.cache
        attn = cast(WhisperEncoderLayer, self.layers[0]).self_attn
        shape = (len(self.layers), 2, attn.num_heads, self.embed_positions.num_embeddings, attn.head_dim)
        buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
        if not state.released:
            state.cache = buffer
        return buffer

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

    def _piece_front(self, piece: StreamPiece, new_frames: int) -> torch.Tensor:
        """One piece through the convolutions plus its positions: ``[1, P // 2, d_model]``; the state's
        ``mel_tail`` moves on (its cache and frame count move on in :meth:`forward_chunks`)."""
        mel, state = piece.mel, piece.state
        dtype = self.conv1.weight.dtype
        parts = [mel]
        left = 0
        tail = state.mel_tail if piece.lookbehind is None else piece.lookbehind
        if tail is not None and tail.shape[-1] > 0:
            parts.insert(0, tail.to(mel.device))
            left = tail.shape[-1]
        if piece.lookahead is not None and piece.lookahead.shape[-1] > 0:
            parts.append(piece.lookahead[:, :2].to(mel.device))
        window = torch.cat(parts, dim=-1).to(dtype)
        # With an even left context the stride-2 grid stays aligned with the offline pass; the first
        # left/2 outputs belong to the previous piece and are dropped.
        x = self._front(window[None])[:, left // 2 : left // 2 + new_frames]
        state.mel_tail = mel[:, -self.CONV_LEFT_CONTEXT :].to(dtype)
        return x + self.embed_positions.weight[state.frames : state.frames + new_frames]


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
