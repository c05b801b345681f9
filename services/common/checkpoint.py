"""Checkpoint contract: the one place that reads the real ``openbmb/MiniCPM-o-4_5`` layout.

Every stage loads through :class:`Checkpoint`, whether the directory holds the real download, the
project's tiny random checkpoint (tests, demo) or the full-size random one (benchmarks). The loader
reads every field from the files (never from class defaults, which differ from the real model) and
every failure raises :class:`CheckpointError` naming the file, key or tensor and what was expected.

Layout (docs/model.md, Checkpoint layout):

* ``config.json`` with ``version == "4.5"``; flat Qwen3 keys plus ``vision_config``, ``audio_config``,
  ``slice_config``, ``tts_config``;
* sharded safetensors through ``model.safetensors.index.json`` (a single ``model.safetensors`` is also
  accepted), memory-mapped; each stage loads only its own prefixes (:data:`STAGE_PREFIXES`);
* the tokenizer files, with every special-token id of docs/model.md, Token ids asserted at load;
* ``preprocessor_config.json``, ``generation_config.json``;
* ``assets/token2wav/{flow.yaml, flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v2_25hz.onnx}`` and
  ``assets/HT_ref_audio.wav``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SUPPORTED_VERSION = "4.5"

STAGE_PREFIXES: dict[str, tuple[str, ...]] = {
    "thinker": ("llm.", "vpm.", "resampler.", "apm.", "audio_projection_layer."),
    "talker": ("tts.",),
}
ALL_PREFIXES: tuple[str, ...] = STAGE_PREFIXES["thinker"] + STAGE_PREFIXES["talker"]

# docs/model.md, Token ids: token -> id. Asserted on every tokenizer load.
SPECIAL_TOKEN_IDS: dict[str, int] = {
    "<unk>": 128244,
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<think>": 151667,
    "</think>": 151668,
    "<image>": 151669,
    "</image>": 151670,
    "<slice>": 151679,
    "</slice>": 151680,
    "<image_id>": 151681,
    "</image_id>": 151682,
    "<unit>": 151683,
    "</unit>": 151684,
    "<focus>": 151687,
    "</perception>": 151692,
    "<|audio_start|>": 151697,
    "<|audio|>": 151698,
    "<|audio_end|>": 151699,
    "<|spk_bos|>": 151700,
    "<|spk|>": 151701,
    "<|spk_eos|>": 151702,
    "<|tts_bos|>": 151703,
    "<|tts_eos|>": 151704,
    "<|listen|>": 151705,
    "<|speak|>": 151706,
    "<|interrupt|>": 151707,
    "<|vad_start|>": 151708,
    "<|vad_end|>": 151709,
    "<|turn_bos|>": 151716,
    "<|turn_eos|>": 151717,
    "<|chunk_eos|>": 151718,
    "<|chunk_bos|>": 151719,
    "<|chunk_tts_bos|>": 151720,
    "<|chunk_tts_eos|>": 151721,
    "<|tts_pad|>": 151722,
    "<|timbre_7|>": 151723,
    "<|timbre_31|>": 151747,
}
MIN_VOCAB_SIZE = 151748
CODEC_EOS_ID = 6561
CODEC_SILENCE_ID = 4218

TOKEN2WAV_FILES = ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
REF_AUDIO = "assets/HT_ref_audio.wav"
TOKENIZER_FILES = ("tokenizer_config.json",)

REQUIRED_CONFIG_KEYS: tuple[str, ...] = (
    "version",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "query_num",
    "image_size",
    "patch_size",
    "audio_pool_step",
    "vision_config",
    "audio_config",
    "slice_config",
    "tts_config",
)
REQUIRED_SUBCONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "vision_config": (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "patch_size",
        "image_size",
    ),
    "audio_config": (
        "d_model",
        "encoder_layers",
        "encoder_attention_heads",
        "encoder_ffn_dim",
        "num_mel_bins",
        "max_source_positions",
    ),
    "slice_config": ("max_slice_nums", "scale_resolution", "patch_size"),
    "tts_config": (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "llm_dim",
        "num_audio_tokens",
        "num_text_tokens",
        "num_vq",
        "audio_bos_token_id",
        "text_eos_token_id",
        "normalize_projected_hidden",
    ),
}


class CheckpointError(ValueError):
    """A checkpoint violates the contract; the message names the file/key/tensor and the expectation."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (required by the MiniCPM-o 4.5 checkpoint layout)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one stored tensor, read from the safetensors header without loading data."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: str


class Checkpoint:
    """A validated view of a MiniCPM-o 4.5 checkpoint directory.

    Opening validates ``config.json`` (version and required keys) and the weight index; heavier checks
    (tokenizer ids, assets) run when those parts are first used, so a stage pays only for what it loads.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: checkpoint directory does not exist")
        self.config: dict[str, Any] = _read_json(self.root / "config.json")
        self._validate_config()
        self.weight_map: dict[str, str] = self._read_weight_map()

    # ----------------------------------------------------------------------------------------- config
    def _validate_config(self) -> None:
        cfg_path = self.root / "config.json"
        version = self.config.get("version")
        if str(version) != SUPPORTED_VERSION:
            raise CheckpointError(
                f"{cfg_path}: key 'version' is {version!r}; this server supports only MiniCPM-o "
                f"version {SUPPORTED_VERSION!r} (2.6 and other versions use a different architecture)"
            )
        for key in REQUIRED_CONFIG_KEYS:
            if key not in self.config:
                raise CheckpointError(f"{cfg_path}: missing required key {key!r}")
        for section, keys in REQUIRED_SUBCONFIG_KEYS.items():
            sub = self.config[section]
            if not isinstance(sub, dict):
                raise CheckpointError(f"{cfg_path}: {section!r} must be an object")
            for key in keys:
                if key not in sub:
                    raise CheckpointError(f"{cfg_path}: missing required key {section}.{key}")
        if int(self.config["vocab_size"]) < MIN_VOCAB_SIZE:
            raise CheckpointError(
                f"{cfg_path}: vocab_size {self.config['vocab_size']} < {MIN_VOCAB_SIZE} "
                "(special token ids go up to 151747)"
            )
        hidden = int(self.config["hidden_size"])
        if hidden % 128:
            raise CheckpointError(
                f"{cfg_path}: hidden_size {hidden} must be a multiple of 128 (resampler heads = hidden // 128)"
            )
        audio = self.config["audio_config"]
        if int(audio["encoder_ffn_dim"]) != 4 * int(audio["d_model"]):
            raise CheckpointError(
                f"{cfg_path}: audio_config.encoder_ffn_dim must equal 4*d_model "
                f"(got {audio['encoder_ffn_dim']} vs d_model {audio['d_model']})"
            )
        tts = self.config["tts_config"]
        if int(tts["llm_dim"]) != hidden:
            raise CheckpointError(f"{cfg_path}: tts_config.llm_dim {tts['llm_dim']} != hidden_size {hidden}")

    @property
    def vision_config(self) -> dict[str, Any]:
        section: dict[str, Any] = self.config["vision_config"]
        return section

    @property
    def audio_config(self) -> dict[str, Any]:
        section: dict[str, Any] = self.config["audio_config"]
        return section

    @property
    def tts_config(self) -> dict[str, Any]:
        section: dict[str, Any] = self.config["tts_config"]
        return section

    @property
    def slice_config(self) -> dict[str, Any]:
        section: dict[str, Any] = self.config["slice_config"]
        return section

    @cached_property
    def preprocessor_config(self) -> dict[str, Any]:
        return _read_json(self.root / "preprocessor_config.json")

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        return _read_json(self.root / "generation_config.json")

    # ---------------------------------------------------------------------------------------- weights
    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.root / "model.safetensors.index.json"
        if index_path.is_file():
            index = _read_json(index_path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: 'weight_map' missing or empty")
            for shard in sorted(set(weight_map.values())):
                if not (self.root / shard).is_file():
                    raise CheckpointError(
                        f"{self.root / shard}: shard listed in {index_path.name} is missing"
                    )
            return {str(k): str(v) for k, v in weight_map.items()}
        single = self.root / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return {k: single.name for k in f.keys()}
        raise CheckpointError(
            f"{self.root}: neither model.safetensors.index.json nor model.safetensors found"
        )

    def tensor_names(self, prefixes: Iterable[str] = ALL_PREFIXES) -> list[str]:
        pre = tuple(prefixes)
        return sorted(k for k in self.weight_map if k.startswith(pre))

    def tensor_infos(self, prefixes: Iterable[str] = ALL_PREFIXES) -> dict[str, TensorInfo]:
        """Shapes and dtypes from the safetensors headers (no tensor data is read)."""
        from safetensors import safe_open

        names = self.tensor_names(prefixes)
        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self.weight_map[name], []).append(name)
        out: dict[str, TensorInfo] = {}
        for shard, shard_names in by_shard.items():
            with safe_open(str(self.root / shard), framework="pt") as f:
                present = set(f.keys())
                for name in shard_names:
                    if name not in present:
                        raise CheckpointError(
                            f"{self.root / shard}: tensor {name!r} listed in the index is not in the shard"
                        )
                    sl = f.get_slice(name)
                    out[name] = TensorInfo(name, tuple(sl.get_shape()), str(sl.get_dtype()), shard)
        return out

    def load_tensors(
        self,
        prefixes: Iterable[str],
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        strip_prefix: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Load every tensor whose name starts with one of ``prefixes`` (memory-mapped per shard).

        ``dtype`` casts floating tensors; ``strip_prefix`` removes a leading namespace such as ``"llm."``.
        """
        from safetensors import safe_open

        pre = tuple(prefixes)
        names = self.tensor_names(pre)
        if not names:
            raise CheckpointError(f"{self.root}: no tensors with prefixes {list(pre)} in the weight index")
        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self.weight_map[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard, shard_names in sorted(by_shard.items()):
            with safe_open(str(self.root / shard), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in shard_names:
                    if name not in present:
                        raise CheckpointError(
                            f"{self.root / shard}: tensor {name!r} listed in the index is not in the shard"
                        )
                    t = f.get_tensor(name)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    key = (
                        name[len(strip_prefix) :] if strip_prefix and name.startswith(strip_prefix) else name
                    )
                    out[key] = t.to(device)
        return out

    def load_stage_tensors(
        self, stage: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Load only the prefixes a stage owns (thinker: llm/vpm/resampler/apm/projector; talker: tts)."""
        if stage not in STAGE_PREFIXES:
            raise CheckpointError(f"unknown stage {stage!r}; expected one of {sorted(STAGE_PREFIXES)}")
        return self.load_tensors(STAGE_PREFIXES[stage], dtype=dtype, device=device)

    @staticmethod
    def expect_shape(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Fetch ``name`` from a loaded dict and check its shape, with a contract error if wrong."""
        if name not in tensors:
            raise CheckpointError(
                f"tensor {name!r} missing from the checkpoint (expected shape {list(shape)})"
            )
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    # -------------------------------------------------------------------------------------- tokenizer
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """Load the fast tokenizer and assert every special-token id of docs/model.md, Token ids."""
        return load_tokenizer(self.root)

    # ----------------------------------------------------------------------------------------- assets
    @property
    def token2wav_dir(self) -> Path:
        d = self.root / "assets" / "token2wav"
        for name in TOKEN2WAV_FILES:
            if not (d / name).is_file():
                raise CheckpointError(f"{d / name}: missing Code2Wav asset")
        return d

    @property
    def ref_audio_path(self) -> Path:
        p = self.root / REF_AUDIO
        if not p.is_file():
            raise CheckpointError(f"{p}: missing default reference voice")
        return p


def load_tokenizer(root: str | Path) -> PreTrainedTokenizerFast:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) and check the special ids.

    Uses ``PreTrainedTokenizerFast`` directly so the remote ``MiniCPMOTokenizerFast`` class is not needed.
    """
    from transformers import PreTrainedTokenizerFast

    root = Path(root)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"{tok_file}: missing tokenizer")
    cfg = _read_json(root / "tokenizer_config.json")
    try:
        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(tok_file),
            bos_token=cfg.get("bos_token", "<|im_start|>"),
            eos_token=cfg.get("eos_token", "<|im_end|>"),
            pad_token=cfg.get("pad_token", "<|endoftext|>"),
            unk_token=cfg.get("unk_token", "<unk>"),
        )
    except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
        raise CheckpointError(f"{tok_file}: cannot be loaded as a fast tokenizer ({exc})") from exc
    if cfg.get("chat_template"):
        tok.chat_template = cfg["chat_template"]
    check_special_ids(tok, str(tok_file))
    if len(tok) < MIN_VOCAB_SIZE:
        raise CheckpointError(f"{tok_file}: {len(tok)} entries, expected at least {MIN_VOCAB_SIZE}")
    return tok


def check_special_ids(tok: PreTrainedTokenizerBase, where: str) -> None:
    for token, want in SPECIAL_TOKEN_IDS.items():
        got = tok.convert_tokens_to_ids(token)
        if got != want:
            raise CheckpointError(f"{where}: special token {token!r} has id {got}, expected {want}")
