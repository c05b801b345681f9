"""The Talker's configuration, read field by field from ``config.json``'s ``tts_config``.

The HF class defaults of ``MiniCPMTTSConfig`` differ from the real model (4097 audio tokens,
``llm_hidden`` conditions, no normalisation), so nothing here falls back to them: every size and id is
required in the file. Only three Llama knobs are fixed constants, because upstream never reads them from
the config either (it builds its ``LlamaConfig`` from the size fields only, so RMSNorm eps, RoPE theta
and the MLP activation are whatever ``LlamaConfig`` defaulted to when the model was trained); they are
spelled out here so a different transformers version cannot change them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.checkpoint import CODEC_EOS_ID, CODEC_SILENCE_ID, CheckpointError

# Llama knobs upstream leaves at the LlamaConfig defaults (docs/model.md, Dimensions: eps 1e-6, theta 10 000,
# SiLU).
LLAMA_RMS_NORM_EPS = 1e-6
LLAMA_ROPE_THETA = 10_000.0
LLAMA_HIDDEN_ACT = "silu"

# Upstream's TTSSamplingParams default temperature (not a tts_config key in the released config).
DEFAULT_TEMPERATURE = 0.8
# vllm-omni's fallback codec seed when neither the request nor tts_config names one.
FALLBACK_SEED = 42
# Upstream whole-utterance limits (MiniCPMTTS.generate defaults).
DEFAULT_MIN_NEW_FRAMES = 50
DEFAULT_MAX_NEW_FRAMES = 2048

SUPPORTED_ATTENTION_TYPES = ("sliding_recompute", "full_attention")


def _require(tts: dict[str, Any], key: str) -> Any:
    if key not in tts:
        raise CheckpointError(f"config.json: missing required key tts_config.{key}")
    return tts[key]


@dataclass(frozen=True)
class TalkerConfig:
    """Every number the Talker needs, with the meaning upstream gives it."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int  # the Talker context (4096): budgets and rollover
    llm_dim: int  # width of the Thinker hidden rows fed to projector_semantic
    num_audio_tokens: int  # codec vocabulary incl. EOS (6562)
    num_text_tokens: int  # rows of emb_text (152064)
    num_vq: int
    audio_bos_token_id: int
    text_eos_token_id: int
    normalize_projected_hidden: bool
    condition_type: str
    projector_type: str
    attention_type: str  # how streaming chunks share context: sliding_recompute | full_attention
    window_size: int
    recomputed_chunks: int
    top_p: float
    top_k: int
    repetition_penalty: float
    temperature: float
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_id(self) -> int:
        return self.num_audio_tokens - 1

    @property
    def silence_id(self) -> int:
        return CODEC_SILENCE_ID

    @classmethod
    def from_tts_config(cls, tts: dict[str, Any]) -> TalkerConfig:
        backbone = str(tts.get("backbone_model", "llama"))
        if backbone != "llama":
            raise CheckpointError(
                f"config.json: tts_config.backbone_model {backbone!r} unsupported (llama only)"
            )
        cfg = cls(
            hidden_size=int(_require(tts, "hidden_size")),
            intermediate_size=int(_require(tts, "intermediate_size")),
            num_hidden_layers=int(_require(tts, "num_hidden_layers")),
            num_attention_heads=int(_require(tts, "num_attention_heads")),
            num_key_value_heads=int(_require(tts, "num_key_value_heads")),
            max_position_embeddings=int(_require(tts, "max_position_embeddings")),
            llm_dim=int(_require(tts, "llm_dim")),
            num_audio_tokens=int(_require(tts, "num_audio_tokens")),
            num_text_tokens=int(_require(tts, "num_text_tokens")),
            num_vq=int(_require(tts, "num_vq")),
            audio_bos_token_id=int(_require(tts, "audio_bos_token_id")),
            text_eos_token_id=int(_require(tts, "text_eos_token_id")),
            normalize_projected_hidden=bool(_require(tts, "normalize_projected_hidden")),
            condition_type=str(_require(tts, "condition_type")),
            projector_type=str(_require(tts, "projector_type")),
            attention_type=str(tts.get("attention_type", "sliding_recompute")),
            window_size=int(tts.get("window_size", 2)),
            recomputed_chunks=int(tts.get("recomputed_chunks", 1)),
            top_p=float(_require(tts, "top_p")),
            top_k=int(_require(tts, "top_k")),
            repetition_penalty=float(_require(tts, "repetition_penalty")),
            temperature=float(tts.get("temperature", DEFAULT_TEMPERATURE)),
            seed=int(tts.get("seed", FALLBACK_SEED)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.condition_type != "hidden_text_merge":
            raise CheckpointError(
                f"config.json: tts_config.condition_type {self.condition_type!r} unsupported "
                "(MiniCPM-o 4.5 uses hidden_text_merge)"
            )
        if self.projector_type != "mlp":
            raise CheckpointError(
                f"config.json: tts_config.projector_type {self.projector_type!r} unsupported"
            )
        if self.num_vq != 1:
            raise CheckpointError(f"config.json: tts_config.num_vq {self.num_vq} unsupported (4.5 has 1)")
        if self.num_audio_tokens - 1 != CODEC_EOS_ID:
            raise CheckpointError(
                f"config.json: tts_config.num_audio_tokens {self.num_audio_tokens} implies EOS "
                f"{self.num_audio_tokens - 1}, the codec contract fixes it at {CODEC_EOS_ID}"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("config.json: tts_config head counts do not divide hidden_size")
        if self.attention_type not in SUPPORTED_ATTENTION_TYPES:
            raise CheckpointError(
                f"config.json: tts_config.attention_type {self.attention_type!r} unsupported "
                f"(supported: {', '.join(SUPPORTED_ATTENTION_TYPES)})"
            )
        if self.attention_type == "sliding_recompute" and self.window_size <= self.recomputed_chunks:
            raise CheckpointError("config.json: sliding_recompute needs window_size > recomputed_chunks")
        for name in ("audio_bos_token_id", "text_eos_token_id"):
            if not 0 <= getattr(self, name) < self.num_text_tokens:
                raise CheckpointError(f"config.json: tts_config.{name} outside emb_text")
