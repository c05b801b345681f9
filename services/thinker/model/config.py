"""Thinker dimensions, read from ``config.json`` through the checkpoint contract.

Every size comes from the checkpoint (docs/model.md, Dimensions warns that the upstream class defaults are not
the real values), so the same code serves the tiny test checkpoint and the real 8B one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import Qwen3Config

from services.common.checkpoint import Checkpoint, CheckpointError

# Keys of the flat top-level config that belong to the Qwen3 text backbone.
_QWEN3_INT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class VisionDims:
    """SigLIP-navit tower sizes; ``num_layers`` already excludes the dropped last layer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def patches_per_side(self) -> int:
        """Side of the learned position table (980 px / 14 px = 70 on the real model)."""
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class AudioDims:
    """Whisper-encoder sizes plus the pooling that turns 50 encoder frames/s into 10 embeddings/s."""

    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    activation: str
    pool_step: int
    chunk_length_s: float

    @property
    def projector_in(self) -> int:
        """Upstream sizes the projector input as ``encoder_ffn_dim // 4`` (equal to ``d_model``)."""
        return self.ffn_dim // 4


@dataclass(frozen=True)
class ThinkerDims:
    """Everything the thinker modules need to be built, without touching tensor data."""

    llm: Qwen3Config
    vision: VisionDims
    audio: AudioDims
    query_num: int
    resampler_heads: int
    vision_batch_size: int

    @property
    def hidden_size(self) -> int:
        return int(self.llm.hidden_size)


def qwen3_config_from_checkpoint(cfg: dict[str, Any]) -> Qwen3Config:
    """Build a transformers ``Qwen3Config`` from the flat MiniCPM-o config (top-level Qwen3 keys)."""
    if cfg.get("attention_bias", False):
        raise CheckpointError(
            "config.json: attention_bias is true, which selects a Qwen2 backbone; only Qwen3 (false) is supported"
        )
    kwargs: dict[str, Any] = {k: int(cfg[k]) for k in _QWEN3_INT_KEYS}
    hidden = kwargs["hidden_size"]
    heads = kwargs["num_attention_heads"]
    kwargs["head_dim"] = int(cfg.get("head_dim") or hidden // heads)
    kwargs["rms_norm_eps"] = float(cfg["rms_norm_eps"])
    kwargs["hidden_act"] = str(cfg.get("hidden_act", "silu"))
    kwargs["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    kwargs["attention_bias"] = False
    kwargs["attention_dropout"] = 0.0
    kwargs["use_sliding_window"] = bool(cfg.get("use_sliding_window", False))
    kwargs["sliding_window"] = cfg.get("sliding_window")
    kwargs["max_window_layers"] = int(cfg.get("max_window_layers", kwargs["num_hidden_layers"]))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    scaling = cfg.get("rope_scaling")
    if scaling:
        rope.update(scaling)
        rope.setdefault("rope_type", scaling.get("type", "default"))
        rope["rope_theta"] = float(cfg["rope_theta"])
    kwargs["rope_parameters"] = rope
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in cfg:
            kwargs[key] = cfg[key]
    config = Qwen3Config(**kwargs)
    # SDPA everywhere: it is exact in fp32 and the fast path on CUDA.
    config._attn_implementation = "sdpa"
    return config


def thinker_dims(ckpt: Checkpoint) -> ThinkerDims:
    """Read the full thinker geometry from a validated checkpoint."""
    cfg = ckpt.config
    vc = ckpt.vision_config
    ac = ckpt.audio_config
    drop_last = bool(cfg.get("drop_vision_last_layer", True))
    vision = VisionDims(
        hidden_size=int(vc["hidden_size"]),
        intermediate_size=int(vc["intermediate_size"]),
        num_layers=int(vc["num_hidden_layers"]) - (1 if drop_last else 0),
        num_heads=int(vc["num_attention_heads"]),
        patch_size=int(vc["patch_size"]),
        image_size=int(vc["image_size"]),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
    )
    audio = AudioDims(
        d_model=int(ac["d_model"]),
        num_layers=int(ac["encoder_layers"]),
        num_heads=int(ac["encoder_attention_heads"]),
        ffn_dim=int(ac["encoder_ffn_dim"]),
        num_mel_bins=int(ac["num_mel_bins"]),
        max_source_positions=int(ac["max_source_positions"]),
        activation=str(ac.get("activation_function", "gelu")),
        pool_step=int(cfg["audio_pool_step"]),
        chunk_length_s=float(cfg.get("audio_chunk_length", 1.0)),
    )
    llm = qwen3_config_from_checkpoint(cfg)
    return ThinkerDims(
        llm=llm,
        vision=vision,
        audio=audio,
        query_num=int(cfg["query_num"]),
        # docs/model.md, Dimensions: the resampler uses one head per 128 channels of the LLM width.
        resampler_heads=int(llm.hidden_size) // 128,
        vision_batch_size=int(cfg.get("vision_batch_size", 16)),
    )
