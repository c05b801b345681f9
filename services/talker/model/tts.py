"""MiniCPMTTS, the Talker: a Llama backbone over condition embeddings that predicts 25 Hz codec ids.

Architecture (docs/model.md, Dimensions): transformers ``LlamaModel`` backbone (its own ``embed_tokens`` is
never used: inputs are always embeddings), ``emb_text`` indexed by Thinker token ids, ``projector_semantic``
(Linear → ReLU → Linear) on Thinker hidden rows, ``emb_code[0]`` for fed-back codec ids and the weight-normed
``head_code[0]`` (materialised once at load as ``W = g · v / ‖v‖`` row-wise, so decode is a plain matmul).

Conditions (docs/model.md, Talker conditioning, ``hidden_text_merge``): each spoken position k contributes
``emb_text(id_k) + L2norm(projector_semantic(hidden_k))``; the mode decides the suffix:

* whole utterance: ``[cond..., emb_text(text_eos), emb_text(audio_bos)]``;
* streaming turn chunk: ``[cond_chunk..., (text_eos if the text is finished), audio_bos]``;
* duplex unit: ``[cond..., audio_bos]``.

This module holds weights and the pure tensor functions; caches, batching and sampling live in
:mod:`services.talker.runner`, :mod:`services.talker.kv_cache` and :mod:`services.talker.sampling`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaModel

from services.common.checkpoint import Checkpoint, CheckpointError
from services.common.device import to_device
from services.common.errors import INVALID_ARGUMENT, StageError
from services.talker.model.config import (
    LLAMA_HIDDEN_ACT,
    LLAMA_RMS_NORM_EPS,
    LLAMA_ROPE_THETA,
    TalkerConfig,
)


class SemanticProjector(nn.Module):
    """Thinker hidden (llm_dim) → Talker width; parameter names match ``tts.projector_semantic.*``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(hidden)))


class MiniCPMTTS(nn.Module):
    """The Talker's weights plus condition building and the codec head."""

    def __init__(self, cfg: TalkerConfig, backbone_vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        llama_cfg = LlamaConfig(
            vocab_size=backbone_vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_hidden_layers=cfg.num_hidden_layers,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=LLAMA_RMS_NORM_EPS,
            hidden_act=LLAMA_HIDDEN_ACT,
            rope_parameters={"rope_type": "default", "rope_theta": LLAMA_ROPE_THETA},
            attention_bias=False,
            mlp_bias=False,
        )
        llama_cfg._attn_implementation = "sdpa"
        self.model = LlamaModel(llama_cfg)
        self.emb_text = nn.Embedding(cfg.num_text_tokens, cfg.hidden_size)
        self.projector_semantic = SemanticProjector(cfg.llm_dim, cfg.hidden_size)
        self.emb_code = nn.ModuleList([nn.Embedding(cfg.num_audio_tokens, cfg.hidden_size)])
        # head_code[0].weight, materialised from the weight-norm parametrisation at load.
        self.head_weight = nn.Parameter(
            torch.empty(cfg.num_audio_tokens, cfg.hidden_size), requires_grad=False
        )

    # ------------------------------------------------------------------------------------- loading
    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> MiniCPMTTS:
        """Build from ``config.json`` + the ``tts.`` tensors, checking every shape against the config."""
        cfg = TalkerConfig.from_tts_config(ckpt.tts_config)
        tensors = ckpt.load_tensors(("tts.",), dtype=torch.float32, strip_prefix="tts.")
        embed_key = "model.embed_tokens.weight"
        if embed_key not in tensors:
            raise CheckpointError(f"tensor 'tts.{embed_key}' missing from the checkpoint")
        backbone_vocab = int(tensors[embed_key].shape[0])
        model = cls(cfg, backbone_vocab)

        g_key, v_key = (
            "head_code.0.parametrizations.weight.original0",
            "head_code.0.parametrizations.weight.original1",
        )
        if g_key not in tensors and "head_code.0.weight_g" in tensors:  # legacy weight_norm naming
            g_key, v_key = "head_code.0.weight_g", "head_code.0.weight_v"
        g = Checkpoint.expect_shape(tensors, g_key, (cfg.num_audio_tokens, 1))
        v = Checkpoint.expect_shape(tensors, v_key, (cfg.num_audio_tokens, cfg.hidden_size))
        head = g * v / v.norm(dim=1, keepdim=True)

        state: dict[str, torch.Tensor] = {"head_weight": head}
        expected = model.state_dict()
        for name, t in tensors.items():
            if name.startswith("head_code."):
                continue
            if name.startswith("projector_spk."):
                continue  # present in the checkpoint, never used at inference (docs/model.md, Dimensions)
            if name not in expected:
                raise CheckpointError(f"unexpected Talker tensor 'tts.{name}' in the checkpoint")
            Checkpoint.expect_shape(tensors, name, tuple(expected[name].shape))
            state[name] = t
        missing = sorted(set(expected) - set(state))
        if missing:
            raise CheckpointError(
                f"Talker tensors missing from the checkpoint: {['tts.' + m for m in missing]}"
            )
        model.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    # ---------------------------------------------------------------------------------- conditions
    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    def validate_condition_inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Typed errors for inputs that would otherwise crash deep inside an embedding or matmul."""
        if token_ids.dim() != 1:
            raise StageError(
                INVALID_ARGUMENT, f"token_ids must be 1-D, got shape {list(token_ids.shape)}", "token_ids"
            )
        if hidden.dim() != 2 or hidden.shape[1] != self.cfg.llm_dim:
            raise StageError(
                INVALID_ARGUMENT,
                f"hidden must be [n, {self.cfg.llm_dim}] (the Thinker width), got {list(hidden.shape)}",
                "hidden",
            )
        if hidden.shape[0] != token_ids.shape[0]:
            raise StageError(
                INVALID_ARGUMENT,
                f"{token_ids.shape[0]} token ids but {hidden.shape[0]} hidden rows; they must align 1:1",
                "hidden",
            )
        if token_ids.numel() and (
            int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.num_text_tokens
        ):
            raise StageError(
                INVALID_ARGUMENT,
                f"token ids must lie in [0, {self.cfg.num_text_tokens}); got range "
                f"[{int(token_ids.min())}, {int(token_ids.max())}]",
                "token_ids",
            )
        if hidden.is_floating_point() and not bool(torch.isfinite(hidden).all()):
            raise StageError(INVALID_ARGUMENT, "hidden contains NaN or Inf", "hidden")

    @torch.inference_mode()
    def condition_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``emb_text(ids) + [L2norm](projector_semantic(hidden))`` → [n, H] (no suffix)."""
        self.validate_condition_inputs(token_ids, hidden)
        ids = to_device(token_ids.to(dtype=torch.long), self.device)
        projected = self.projector_semantic(to_device(hidden, self.device).to(dtype=self.dtype))
        if self.cfg.normalize_projected_hidden:
            projected = F.normalize(projected, p=2, dim=-1)
        return self.emb_text(ids) + projected

    @torch.inference_mode()
    def special_rows(self, *token_ids: int) -> torch.Tensor:
        return self.emb_text(to_device(torch.tensor(list(token_ids), dtype=torch.long), self.device))

    def whole_utterance_condition(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Upstream ``_generate_speech_non_streaming``: cond rows + text_eos + audio_bos."""
        rows = self.condition_rows(token_ids, hidden)
        suffix = self.special_rows(self.cfg.text_eos_token_id, self.cfg.audio_bos_token_id)
        return torch.cat([rows, suffix], dim=0)

    def streaming_chunk_condition(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, text_finished: bool
    ) -> torch.Tensor:
        """Upstream ``TTSStreamingGenerator``: cond chunk [+ text_eos when finished] + audio_bos."""
        rows = self.condition_rows(token_ids, hidden)
        ids = [self.cfg.text_eos_token_id] if text_finished else []
        suffix = self.special_rows(*ids, self.cfg.audio_bos_token_id)
        return torch.cat([rows, suffix], dim=0)

    def duplex_unit_condition(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Upstream duplex ``_convert_results_to_tts_input``: cond rows + audio_bos (no text_eos)."""
        rows = self.condition_rows(token_ids, hidden)
        return torch.cat([rows, self.special_rows(self.cfg.audio_bos_token_id)], dim=0)

    @torch.inference_mode()
    def code_rows(self, codes: torch.Tensor) -> torch.Tensor:
        return self.emb_code[0](codes.to(device=self.device, dtype=torch.long))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw codec logits in fp32 (upstream computes ``head_code`` then ``.float()``)."""
        return F.linear(hidden, self.head_weight).float()
