"""The JSON files of a generated checkpoint: ``config.json``, ``generation_config.json``,
``preprocessor_config.json``.

Only widths and depths differ between ``tiny`` and ``full``; every key that encodes a contract (vocab sizes,
token ids, codec vocabulary, image/patch sizes, Whisper mel bins and positions, Talker context) keeps its
real value in both (docs/model.md, Dimensions and Tiny checkpoint), so code exercised on the tiny checkpoint
reads the same keys as on the real download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SIZES = ("tiny", "full")


@dataclass(frozen=True)
class Dims:
    """Width/depth knobs that are allowed to shrink; everything else in the config is fixed."""

    llm_hidden: int
    llm_ffn: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_head_dim: int
    vision_hidden: int
    vision_ffn: int
    vision_layers: int  # as written in the config; the last one is not stored (drop_vision_last_layer)
    vision_heads: int
    audio_d_model: int
    audio_layers: int
    audio_heads: int
    tts_hidden: int
    tts_ffn: int
    tts_layers: int
    tts_heads: int


# docs/model.md, Tiny checkpoint (tiny) and Dimensions (full = the real model).
DIMS: dict[str, Dims] = {
    "tiny": Dims(
        llm_hidden=128,
        llm_ffn=256,
        llm_layers=2,
        llm_heads=4,
        llm_kv_heads=2,
        llm_head_dim=32,
        vision_hidden=64,
        vision_ffn=128,
        vision_layers=2,
        vision_heads=4,
        audio_d_model=64,
        audio_layers=2,
        audio_heads=4,
        tts_hidden=64,
        tts_ffn=128,
        tts_layers=2,
        tts_heads=4,
    ),
    "full": Dims(
        llm_hidden=4096,
        llm_ffn=12288,
        llm_layers=36,
        llm_heads=32,
        llm_kv_heads=8,
        llm_head_dim=128,
        vision_hidden=1152,
        vision_ffn=4304,
        vision_layers=27,
        vision_heads=16,
        audio_d_model=1024,
        audio_layers=24,
        audio_heads=16,
        tts_hidden=768,
        tts_ffn=3072,
        tts_layers=20,
        tts_heads=12,
    ),
}

LLM_VOCAB_SIZE = 151748
TTS_TEXT_VOCAB = 152064
CODEC_VOCAB = 6562


def _vision_config(d: Dims) -> dict[str, Any]:
    return {
        "model_type": "siglip",
        "hidden_size": d.vision_hidden,
        "intermediate_size": d.vision_ffn,
        "num_hidden_layers": d.vision_layers,
        "num_attention_heads": d.vision_heads,
        "num_channels": 3,
        "patch_size": 14,
        # 980 px -> a 70x70 position table (4900 rows); the navit SigLIP interpolates from it.
        "image_size": 980,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "attention_dropout": 0.0,
    }


def _audio_config(d: Dims) -> dict[str, Any]:
    # A Whisper config; only the encoder is used, but the decoder keys are part of the real file.
    return {
        "model_type": "whisper",
        "d_model": d.audio_d_model,
        "encoder_layers": d.audio_layers,
        "encoder_attention_heads": d.audio_heads,
        "encoder_ffn_dim": 4 * d.audio_d_model,  # the projector input is encoder_ffn_dim // 4
        "decoder_layers": d.audio_layers,
        "decoder_attention_heads": d.audio_heads,
        "decoder_ffn_dim": 4 * d.audio_d_model,
        "num_hidden_layers": d.audio_layers,
        "num_mel_bins": 80,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "vocab_size": 51865,
        "activation_function": "gelu",
        "activation_dropout": 0.0,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "scale_embedding": False,
        "apply_spec_augment": False,
        "use_weighted_layer_sum": False,
        "init_std": 0.02,
        "bos_token_id": 50257,
        "eos_token_id": 50257,
        "pad_token_id": 50257,
        "decoder_start_token_id": 50258,
        "use_cache": True,
    }


def _tts_config(d: Dims) -> dict[str, Any]:
    return {
        "model_type": "minicpmtts",
        "backbone_model": "llama",
        "hidden_size": d.tts_hidden,
        "intermediate_size": d.tts_ffn,
        "num_hidden_layers": d.tts_layers,
        "num_attention_heads": d.tts_heads,
        "num_key_value_heads": d.tts_heads,  # MHA; present because ports read it directly
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "llm_dim": d.llm_hidden,
        "projector_type": "mlp",
        "num_audio_tokens": CODEC_VOCAB,  # 0..6560 speech codes, 6561 = EOS
        "num_text_tokens": TTS_TEXT_VOCAB,
        "num_vq": 1,
        "num_mel_bins": 100,
        "audio_bos_token_id": 151687,
        "text_eos_token_id": 151692,
        "use_text": True,
        "use_llm_hidden_state": False,
        "condition_type": "hidden_text_merge",
        "normalize_projected_hidden": True,
        "audio_tokenizer_type": "s3tokenizer_step_audio",
        "audio_tokenizer_sample_rate": 24000,
        "attention_type": "sliding_recompute",
        "window_size": 2,
        "recomputed_chunks": 1,
        "streaming": False,
        "streaming_text_chunk_min": 3,
        "streaming_text_chunk_max": 7,
        "streaming_text_reserved_len": 300,
        "streaming_audio_chunk_size": 50,
        "streaming_sliding_window": False,
        "streaming_sliding_window_max_text_len": 500,
        "interleaved": False,
        "attn_implementation": "sdpa",
        "top_p": 0.85,
        "top_k": 25,
        "repetition_penalty": 1.05,
    }


def build_config(size: str) -> dict[str, Any]:
    """The full ``config.json`` for ``size`` ("tiny" or "full")."""
    d = DIMS[size]
    return {
        "architectures": ["MiniCPMO"],
        "model_type": "minicpmo",
        "version": "4.5",
        "auto_map": {
            "AutoConfig": "configuration_minicpmo.MiniCPMOConfig",
            "AutoModel": "modeling_minicpmo.MiniCPMO",
            "AutoModelForCausalLM": "modeling_minicpmo.MiniCPMO",
        },
        "torch_dtype": "bfloat16",
        # Qwen3 text backbone (flat keys). attention_bias false selects Qwen3 over Qwen2 in ports.
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": d.llm_hidden,
        "intermediate_size": d.llm_ffn,
        "num_hidden_layers": d.llm_layers,
        "num_attention_heads": d.llm_heads,
        "num_key_value_heads": d.llm_kv_heads,
        "head_dim": d.llm_head_dim,
        "max_window_layers": d.llm_layers,
        "vocab_size": LLM_VOCAB_SIZE,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        # Multimodal wiring.
        "query_num": 64,
        "image_size": 448,
        "patch_size": 14,
        "drop_vision_last_layer": True,
        "batch_vision_input": True,
        "use_image_id": True,
        "vision_batch_size": 16,
        "slice_mode": True,
        "audio_pool_step": 5,
        "audio_chunk_length": 1.0,
        "stream_input": False,
        "listen_speak_type": "asr",
        "init_vision": True,
        "init_audio": True,
        "init_tts": True,
        "slice_config": {
            "model_type": "minicpmv",
            "max_slice_nums": 9,
            "patch_size": 14,
            "scale_resolution": 448,
        },
        "vision_config": _vision_config(d),
        "audio_config": _audio_config(d),
        "tts_config": _tts_config(d),
    }


def build_generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def build_preprocessor_config() -> dict[str, Any]:
    return {
        "processor_class": "MiniCPMOProcessor",
        "image_processor_type": "MiniCPMVImageProcessor",
        "feature_extractor_type": "MiniCPMAAudioProcessor",
        "auto_map": {
            "AutoProcessor": "processing_minicpmo.MiniCPMOProcessor",
            "AutoImageProcessor": "processing_minicpmo.MiniCPMVImageProcessor",
            "AutoFeatureExtractor": "processing_minicpmo.MiniCPMAAudioProcessor",
        },
        "version": 4.5,
        "slice_mode": True,
        "max_slice_nums": 9,
        "scale_resolution": 448,
        "patch_size": 14,
        "use_image_id": True,
        "image_feature_size": 64,
        "audio_pool_step": 5,
        "norm_mean": [0.5, 0.5, 0.5],
        "norm_std": [0.5, 0.5, 0.5],
        "im_start": "<image>",
        "im_end": "</image>",
        "slice_start": "<slice>",
        "slice_end": "</slice>",
        "im_id_start": "<image_id>",
        "im_id_end": "</image_id>",
        "unk": "<unk>",
    }
