"""Random weights for the safetensors shards, generated tensor by tensor and written shard by shard.

Names and shapes come from the standard module classes instantiated on the ``meta`` device (transformers
``Qwen3ForCausalLM``, ``SiglipVisionModel``, ``WhisperEncoder``, ``LlamaModel`` and a few plain ``nn``
layers), so they match the real checkpoint without allocating anything; this is what lets ``--size full``
enumerate an 8.7 B-parameter model instantly and then materialise one tensor at a time.

Each tensor is drawn from its own generator seeded by ``sha256(seed/file/name)``: the bytes of a tensor
depend only on the seed, the file and its name, never on generation order, so shards can be planned and
written independently and two runs give identical files.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The resampler uses one attention head per 128 channels of the LLM width (docs/model.md, Dimensions).
RESAMPLER_HEAD_DIM = 128


def print_progress(message: str) -> None:
    """Default progress sink: flushed, so progress shows up live when stdout is a pipe or a log file."""
    print(message, flush=True)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]


# ------------------------------------------------------------------------------------------ init rules
_EMBEDDING_PAT = re.compile(
    r"(embed_tokens|emb_text|emb_code\.\d+|position_embedding|embed_positions|input_embedding)\.weight$"
    r"|^resampler\.query$"
)
_GAIN_PAT = re.compile(r"(norm|_ln|ln_|layernorm|layer_norm)[^.]*\.weight$|original0$|alpha$")


def init_kind(name: str, shape: tuple[int, ...]) -> str:
    """Which distribution a tensor gets: 'embedding' N(0,1), 'gain' 1+0.1N, 'bias' 0.05N, 'fan_in' N(0,1/fan_in).

    Unit-variance embeddings keep the input token visible through random residual branches (with 1/sqrt(d)
    embeddings a random Talker's greedy output collapses to one repeated code), and 1/fan_in weights keep
    activations at unit scale through depth.
    """
    if _EMBEDDING_PAT.search(name):
        return "embedding"
    if _GAIN_PAT.search(name) and (len(shape) <= 1 or name.endswith("original0")):
        return "gain"
    if len(shape) <= 1:
        return "gain" if name.endswith("weight") else "bias"
    return "fan_in"


def tensor_seed(seed: int, file: str, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{file}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def make_tensor(
    seed: int, file: str, spec: TensorSpec, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Materialise one tensor by the init rules; float32 draws, cast to ``dtype`` at the end."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, file, spec.name))
    t = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    kind = init_kind(spec.name, spec.shape)
    if kind == "gain":
        t.mul_(0.1).add_(1.0)
    elif kind == "bias":
        t.mul_(0.05)
    elif kind == "fan_in":
        fan_in = max(1, t.numel() // spec.shape[0])
        t.mul_(fan_in**-0.5)
    return t.to(dtype)


# --------------------------------------------------------------------------------------- name census
class _Resampler(nn.Module):
    """Parameter layout of the perceiver resampler (docs/model.md, Weight prefixes); only the names/shapes
    matter here."""

    def __init__(self, num_queries: int, embed_dim: int, kv_dim: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.empty(num_queries, embed_dim))
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, max(1, embed_dim // RESAMPLER_HEAD_DIM))
        self.ln_q = nn.LayerNorm(embed_dim)
        self.ln_kv = nn.LayerNorm(embed_dim)
        self.ln_post = nn.LayerNorm(embed_dim)
        self.proj = nn.Parameter(torch.empty(embed_dim, embed_dim))


class _TwoLayerMLP(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.linear2 = nn.Linear(out_dim, out_dim)


class _TalkerExtras(nn.Module):
    """The Talker's tables and heads around its Llama backbone (names as in the real ``tts.`` prefix)."""

    def __init__(self, tts: dict[str, Any]) -> None:
        super().__init__()
        hidden, llm_dim = int(tts["hidden_size"]), int(tts["llm_dim"])
        n_codes, n_vq = int(tts["num_audio_tokens"]), int(tts["num_vq"])
        self.emb_text = nn.Embedding(int(tts["num_text_tokens"]), hidden)
        self.emb_code = nn.ModuleList(nn.Embedding(n_codes, hidden) for _ in range(n_vq))
        self.projector_semantic = _TwoLayerMLP(llm_dim, hidden)
        self.projector_spk = _TwoLayerMLP(llm_dim, hidden)
        self.head_code = nn.ModuleList(
            nn.utils.parametrizations.weight_norm(nn.Linear(hidden, n_codes, bias=False)) for _ in range(n_vq)
        )


def _shapes(
    module: nn.Module, prefix: str, keep: Callable[[str], bool] = lambda _k: True
) -> list[TensorSpec]:
    out = []
    for key, value in module.state_dict().items():
        if key.endswith("position_ids") or not value.is_floating_point():
            continue  # non-persistent index buffers are not part of the real checkpoint
        if keep(key):
            out.append(TensorSpec(prefix + key, tuple(value.shape)))
    return out


def _silence_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def thinker_specs(cfg: dict[str, Any]) -> list[TensorSpec]:
    """llm., vpm., resampler., apm., audio_projection_layer. tensors implied by ``config.json``."""
    _silence_transformers()
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
        WhisperConfig,
    )
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    llm_keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "attention_bias",
        "tie_word_embeddings",
    )
    vc, ac = cfg["vision_config"], cfg["audio_config"]
    specs: list[TensorSpec] = []
    with torch.device("meta"):
        llm = Qwen3ForCausalLM(Qwen3Config(**{k: cfg[k] for k in llm_keys if k in cfg}))
        specs += _shapes(llm, "llm.")
        del llm
        vision = SiglipVisionModel(
            SiglipVisionConfig(
                **{**{k: v for k, v in vc.items() if k != "model_type"}, "vision_use_head": False}
            )
        )
        stored_layers = int(vc["num_hidden_layers"]) - (1 if cfg.get("drop_vision_last_layer", True) else 0)

        def keep_layer(key: str) -> bool:
            m = re.match(r"(?:vision_model\.)?encoder\.layers\.(\d+)\.", key)
            return m is None or int(m.group(1)) < stored_layers

        specs += [
            TensorSpec(s.name.replace("vpm.vision_model.", "vpm."), s.shape)
            for s in _shapes(vision, "vpm.", keep_layer)
        ]
        hidden = int(cfg["hidden_size"])
        specs += _shapes(_Resampler(int(cfg["query_num"]), hidden, int(vc["hidden_size"])), "resampler.")
        whisper_cfg = WhisperConfig(**{k: v for k, v in ac.items() if k != "model_type"})
        specs += _shapes(WhisperEncoder(whisper_cfg), "apm.")
        specs += _shapes(_TwoLayerMLP(int(ac["encoder_ffn_dim"]) // 4, hidden), "audio_projection_layer.")
    return specs


def talker_specs(cfg: dict[str, Any]) -> list[TensorSpec]:
    """tts. tensors: a LlamaModel backbone (keeps LlamaConfig's default 32000-row table) plus the extras."""
    _silence_transformers()
    from transformers import LlamaConfig, LlamaModel

    tts = cfg["tts_config"]
    backbone_cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=int(tts["hidden_size"]),
        intermediate_size=int(tts["intermediate_size"]),
        num_hidden_layers=int(tts["num_hidden_layers"]),
        num_attention_heads=int(tts["num_attention_heads"]),
        num_key_value_heads=int(tts.get("num_key_value_heads", tts["num_attention_heads"])),
        max_position_embeddings=int(tts["max_position_embeddings"]),
    )
    with torch.device("meta"):
        return _shapes(LlamaModel(backbone_cfg), "tts.model.") + _shapes(_TalkerExtras(tts), "tts.")


def all_specs(cfg: dict[str, Any]) -> list[TensorSpec]:
    return thinker_specs(cfg) + talker_specs(cfg)


# ------------------------------------------------------------------------------------------- sharding
BF16_BYTES = 2
PROGRESS_EVERY_BYTES = 2**30  # full size: a progress line per GiB drawn, and one per shard written


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Group tensors into shards.

    ``None`` splits by stage the way a small checkpoint is easiest to inspect: ``llm.`` in the first shard,
    everything else in the second. A byte budget packs tensors in order until the next one would overflow.
    """
    if max_shard_bytes is None:
        first = [s for s in specs if s.name.startswith("llm.")]
        rest = [s for s in specs if not s.name.startswith("llm.")]
        return [g for g in (first, rest) if g]
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        size = BF16_BYTES * _numel(spec.shape)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def write_sharded_weights(
    out_dir: Path,
    specs: list[TensorSpec],
    *,
    seed: int,
    device: str = "cpu",
    max_shard_bytes: int | None = None,
    log: Callable[[str], None] = print_progress,
) -> dict[str, Any]:
    """Generate and write every shard plus ``model.safetensors.index.json``; returns the index.

    Only one shard's tensors are alive at a time (bf16, on the CPU), so peak memory is one shard.
    """
    from safetensors.torch import save_file

    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    total_bytes = sum(BF16_BYTES * _numel(s.shape) for s in specs)
    weight_map: dict[str, str] = {}
    done_bytes = 0
    t0 = time.monotonic()
    for i, group in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        since_log = 0
        for spec in group:
            # Seeded by tensor name only (not the shard file), so re-sharding keeps the values.
            t = make_tensor(seed, "model", spec, device=device, dtype=torch.bfloat16)
            tensors[spec.name] = t.cpu() if t.device.type != "cpu" else t
            weight_map[spec.name] = fname
            since_log += t.numel() * t.element_size()
            if since_log >= PROGRESS_EVERY_BYTES:
                drawn = done_bytes + sum(x.numel() * x.element_size() for x in tensors.values())
                log(
                    f"    drawing {fname}: {drawn / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB "
                    f"({time.monotonic() - t0:.0f} s)"
                )
                since_log = 0
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        done_bytes += shard_bytes
        del tensors
        log(
            f"  [{i}/{n}] {fname}: {len(group)} tensors, {shard_bytes / 2**20:.1f} MiB "
            f"({100 * done_bytes / max(total_bytes, 1):.0f}% of {total_bytes / 2**30:.2f} GiB, "
            f"{time.monotonic() - t0:.1f} s)"
        )
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index
