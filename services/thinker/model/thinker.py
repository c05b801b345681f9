"""The MiniCPM-o 4.5 thinker as plain PyTorch modules: Qwen3 LLM + SigLIP/resampler + Whisper/projector.

Submodule names equal the checkpoint prefixes (``llm.``, ``vpm.``, ``resampler.``, ``apm.``,
``audio_projection_layer.``), so the stored tensors load by name, strictly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from services.common.checkpoint import STAGE_PREFIXES, Checkpoint, CheckpointError
from services.common.device import to_device
from services.thinker.model.audio import (
    ENCODER_FRAMES_PER_SECOND,
    AudioProjector,
    AudioStreamState,
    StreamPiece,
    WhisperChunkedEncoder,
    pool_embeddings,
    pooled_length,
)
from services.thinker.model.config import ThinkerDims, thinker_dims
from services.thinker.model.vision import Resampler, SiglipNavitTower


class PromptTensors(Protocol):
    """What :meth:`ThinkerModel.embed_prompt` reads (``ProcessedPrompt`` of the processor has it)."""

    input_ids: torch.Tensor
    pixel_values: list[torch.Tensor]
    tgt_sizes: torch.Tensor
    image_bounds: torch.Tensor
    audio_features: torch.Tensor
    audio_feature_lens: torch.Tensor
    audio_bounds: torch.Tensor


def _spans_to_indices(bounds: torch.Tensor) -> torch.Tensor:
    if bounds.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(int(s), int(e)) for s, e in bounds.tolist()])


class ThinkerModel(nn.Module):
    """Thinker modules plus the glue that turns a processed prompt into LLM input embeddings."""

    def __init__(self, dims: ThinkerDims) -> None:
        super().__init__()
        self.dims = dims
        hidden = dims.hidden_size
        self.llm = Qwen3ForCausalLM(dims.llm)
        self.vpm = SiglipNavitTower(dims.vision)
        self.resampler = Resampler(dims.query_num, hidden, dims.resampler_heads, dims.vision.hidden_size)
        self.apm = WhisperChunkedEncoder(dims.audio)
        self.audio_projection_layer = AudioProjector(dims.audio.projector_in, hidden)

    # ------------------------------------------------------------------------------------- loading
    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint | str,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> ThinkerModel:
        """Build the modules on the meta device and assign the stored tensors (no random init pass)."""
        if not isinstance(ckpt, Checkpoint):
            ckpt = Checkpoint(ckpt)
        dims = thinker_dims(ckpt)
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(dims)
        tensors = ckpt.load_tensors(STAGE_PREFIXES["thinker"], dtype=dtype, device=device)
        # drop_vision_last_layer: a checkpoint may still store the last SigLIP layer; it is never used.
        layer_re = re.compile(r"^vpm\.encoder\.layers\.(\d+)\.")
        for name in list(tensors):
            m = layer_re.match(name)
            if m and int(m.group(1)) >= dims.vision.num_layers:
                del tensors[name]
        if dims.llm.tie_word_embeddings and "llm.lm_head.weight" not in tensors:
            tensors["llm.lm_head.weight"] = tensors["llm.model.embed_tokens.weight"]
        expected = set(model.state_dict().keys())
        missing = sorted(expected - set(tensors))
        unexpected = sorted(set(tensors) - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"{ckpt.root}: thinker weights do not match config.json "
                f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''})"
            )
        for name, want in model.state_dict().items():
            got = tensors[name]
            if tuple(got.shape) != tuple(want.shape):
                raise CheckpointError(
                    f"{ckpt.root}: tensor {name!r} has shape {list(got.shape)}, config.json implies {list(want.shape)}"
                )
        model.load_state_dict(tensors, strict=True, assign=True)
        # The rotary table is a non-persistent buffer: rebuild it on the real device, in float32.
        # (transformers versions differ on a ``device`` argument, so build it under a device context.)
        with torch.device(device):
            model.llm.model.rotary_emb = Qwen3RotaryEmbedding(config=dims.llm)
        for name, buf in model.named_buffers():
            if buf.is_meta:
                raise RuntimeError(f"buffer {name} was not materialised")
        return model.eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------ accessors
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.llm.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.llm.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # --------------------------------------------------------------------------------------- vision
    @torch.inference_mode()
    def get_vision_embeds(
        self, pixel_values_list: Sequence[torch.Tensor], tgt_sizes: torch.Tensor
    ) -> torch.Tensor:
        """Slices in patch layout (each ``[3, patch, patch * h * w]``) + ``tgt_sizes`` [n, 2] -> [n, Q, H].

        Slices are encoded in groups of ``vision_batch_size``; each slice's result does not depend on
        its batch neighbours (padding is masked).
        """
        n = len(pixel_values_list)
        if n == 0:
            return torch.zeros(
                0, self.dims.query_num, self.dims.hidden_size, dtype=self.dtype, device=self.device
            )
        tgt = torch.as_tensor(tgt_sizes).to(torch.long).reshape(n, 2).cpu()
        patch = self.dims.vision.patch_size
        outputs = []
        step = max(1, self.dims.vision_batch_size)
        for start in range(0, n, step):
            group = pixel_values_list[start : start + step]
            gt = tgt[start : start + step]
            width = max(int(p.shape[-1]) for p in group)
            batch = torch.zeros(len(group), 3, patch, width, dtype=self.dtype, device=self.device)
            for i, p in enumerate(group):
                batch[i, :, :, : p.shape[-1]] = p.to(device=self.device, dtype=self.dtype)
            feats = self.vpm(batch, gt)
            outputs.append(self.resampler(feats, gt))
        return torch.cat(outputs, dim=0)

    # ---------------------------------------------------------------------------------------- audio
    @torch.inference_mode()
    def get_audio_embeds(
        self, features: torch.Tensor, feature_lens: torch.Tensor, chunk_length: float | None = 1.0
    ) -> list[torch.Tensor]:
        """Mel pieces ``[N, n_mels, T]`` (zero padded) + lengths [N] -> N tensors ``[n_i, H]``.

        ``n_i = ((len_i - 1) // 2 + 1 - pool) // pool + 1`` (10 per second). ``chunk_length`` seconds per
        attention chunk (1.0 as upstream; ``None`` or <= 0 = full attention).
        """
        if features.numel() == 0 or features.shape[0] == 0:
            return []
        lens = torch.as_tensor(feature_lens).to(torch.long).reshape(-1).cpu()
        chunk = int(chunk_length * ENCODER_FRAMES_PER_SECOND) if chunk_length and chunk_length > 0 else None
        states = self.apm(features.to(self.device), lens, chunk)
        pooled = pool_embeddings(self.audio_projection_layer(states), self.dims.audio.pool_step)
        counts = pooled_length(lens, self.dims.audio.pool_step)
        return [pooled[i, : int(counts[i])] for i in range(len(lens))]

    def audio_stream_bytes(self) -> int:
        """Most memory one duplex session's Whisper cache holds: every layer's K and V for the encoder's
        ``max_source_positions`` frames (the stream resets before passing them). 147 MB at full size."""
        a = self.dims.audio
        elem = self.apm.conv1.weight.element_size()
        return 2 * a.num_layers * a.max_source_positions * a.d_model * elem

    def new_audio_stream(self) -> AudioStreamState:
        """A fresh incremental-Whisper state for one duplex session (see :meth:`get_audio_embeds_streaming`)."""
        return AudioStreamState()

    def reserve_audio_streams(self, sessions: int) -> None:
        """Size the duplex sessions' pooled Whisper cache for ``sessions`` at once (allocated at the first
        pass; it grows past that with a warning)."""
        self.apm.stream_pool.capacity = max(1, sessions)

    @torch.inference_mode()
    def get_audio_embeds_streaming(
        self,
        mel: torch.Tensor,
        state: AudioStreamState,
        lookahead: torch.Tensor | None = None,
        lookbehind: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One duplex unit: ``mel`` [n_mels, 100] (1 s) -> ``[10, H]``, reusing the session's Whisper cache.

        Matches :meth:`get_audio_embeds` on the concatenated mel when every unit is 100 frames and
        ``lookahead`` carries the next unit's first mel frames (``None`` only for the last unit);
        ``lookbehind`` overrides the left context kept from the previous unit (the duplex front end passes
        its recomputed frames). The caller resets ``state`` (``state.reset()``) before it would pass
        ``max_source_positions``.
        """
        return self.get_audio_embeds_streaming_batch([StreamPiece(mel, state, lookahead, lookbehind)])[0]

    @torch.inference_mode()
    def get_audio_embeds_streaming_batch(self, pieces: Sequence[StreamPiece]) -> torch.Tensor:
        """The next unit of several duplex sessions in one encoder pass: ``[B, 10, H]``, states updated.

        Row b equals :meth:`get_audio_embeds_streaming` of piece b alone up to float rounding (each session
        keeps its own slot of the pooled cache; see :meth:`WhisperChunkedEncoder.forward_chunks`). Host
        pieces go to the device in one copy per window shape, without a stream sync, so the encoder never
        waits for the engine's queued steps.
        """
        enc = self.apm.forward_chunks(pieces)
        return pool_embeddings(self.audio_projection_layer(enc), self.dims.audio.pool_step)

    # ---------------------------------------------------------------------------------------- merge
    def merge_embeddings(
        self,
        input_ids: torch.Tensor,
        vision_embeds: torch.Tensor | None = None,
        image_bounds: torch.Tensor | None = None,
        audio_embeds: Sequence[torch.Tensor] | None = None,
        audio_bounds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text rows from ``embed_tokens``; placeholder spans overwritten by vision/audio rows in order.

        ``vision_embeds`` [n_spans, Q, H] fills ``image_bounds`` (one ``[start, end)`` span per slice);
        the audio rows are concatenated and fill the ``audio_bounds`` spans in prompt order.
        """
        ids = to_device(input_ids, self.device).reshape(-1)
        embeds = self.embed_tokens(ids).clone()
        if image_bounds is not None and image_bounds.numel():
            idx = to_device(_spans_to_indices(image_bounds), self.device)
            rows = (vision_embeds if vision_embeds is not None else torch.zeros(0)).reshape(
                -1, embeds.shape[-1]
            )
            if rows.shape[0] != idx.numel():
                raise ValueError(f"{rows.shape[0]} vision rows for {idx.numel()} image placeholder positions")
            embeds[idx] = rows.to(embeds.dtype)
        if audio_bounds is not None and audio_bounds.numel():
            idx = to_device(_spans_to_indices(audio_bounds), self.device)
            rows = torch.cat(list(audio_embeds), 0) if audio_embeds else torch.zeros(0, embeds.shape[-1])
            if rows.shape[0] != idx.numel():
                raise ValueError(f"{rows.shape[0]} audio rows for {idx.numel()} audio placeholder positions")
            embeds[idx] = rows.to(device=embeds.device, dtype=embeds.dtype)
        return embeds

    @torch.inference_mode()
    def embed_prompt(self, processed: PromptTensors, chunk_length: float | None = None) -> torch.Tensor:
        """Processed prompt -> ``inputs_embeds`` [L, H] (vision and audio encoders run here)."""
        vision = None
        if processed.image_bounds.numel():
            vision = self.get_vision_embeds(processed.pixel_values, processed.tgt_sizes)
        audio = None
        if processed.audio_bounds.numel():
            chunk = self.dims.audio.chunk_length_s if chunk_length is None else chunk_length
            audio = self.get_audio_embeds(processed.audio_features, processed.audio_feature_lens, chunk)
        return self.merge_embeddings(
            processed.input_ids, vision, processed.image_bounds, audio, processed.audio_bounds
        )

    # -------------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward_hidden(self, inputs_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No-cache reference pass: ``[L, H]`` -> (final post-norm hidden ``[L, H]``, next-token logits ``[V]``)."""
        x = inputs_embeds.to(device=self.device, dtype=self.dtype)[None]
        positions = torch.arange(x.shape[1], device=self.device)[None]
        hidden = self.llm.model(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state[0]
        return hidden, self.lm_head(hidden[-1])

    @torch.inference_mode()
    def greedy_no_cache(self, inputs_embeds: torch.Tensor, steps: int) -> list[int]:
        """Greedy ids by re-running the whole sequence each step (slow; for dumps and tests only)."""
        seq = inputs_embeds.to(device=self.device, dtype=self.dtype)
        out: list[int] = []
        for _ in range(steps):
            _, logits = self.forward_hidden(seq)
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq = torch.cat([seq, self.embed_tokens(torch.tensor([nxt], device=self.device))], 0)
        return out
