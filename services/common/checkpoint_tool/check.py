"""``minicpmo-checkpoint check DIR``: validate any checkpoint directory against the contract.

Works on the real download, on our generated checkpoints and on checkpoints written by other tools: every
expectation is derived from the directory's own ``config.json`` (expected tensor names and shapes come from
the standard module classes built on the ``meta`` device from that config), and vocabulary sizes are read
from the files. The first violation raises :class:`CheckpointError` naming the file, key or tensor and what
was expected; ``run_check`` prints it and returns exit code 1.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from services.common.checkpoint import (
    ALL_PREFIXES,
    CODEC_EOS_ID,
    MIN_VOCAB_SIZE,
    REF_AUDIO,
    SPECIAL_TOKEN_IDS,
    STAGE_PREFIXES,
    TOKEN2WAV_FILES,
    Checkpoint,
    CheckpointError,
)

from .token2wav_assets import FLOW_TAGS, load_flow_yaml
from .weights import TensorSpec, all_specs

REQUIRED_ROOT_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Fixed by the streaming Code2Wav path (docs/model.md, Tiny checkpoint): DiT scratch buffers are sized for
# these.
DIT_FIXED = {"hidden_size": 512, "num_heads": 8, "head_dim": 64}
S3_HEAD_DIM = 64

# Which config key explains each expected tensor dimension, for readable shape errors.
_SHAPE_HINT = (
    ("llm.", "hidden_size / intermediate_size / num_*_heads / head_dim / vocab_size"),
    ("vpm.", "vision_config"),
    ("resampler.", "hidden_size / query_num / vision_config.hidden_size"),
    ("apm.", "audio_config"),
    ("audio_projection_layer.", "audio_config.encoder_ffn_dim // 4 -> hidden_size"),
    ("tts.", "tts_config"),
)


@dataclass
class CheckReport:
    """What the checker found; printed as the one-screen summary."""

    root: Path
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.lines.append(f"  {label:<22} {text}")


def _fail(msg: str) -> NoReturn:
    raise CheckpointError(msg)


# -------------------------------------------------------------------------------------------- layout
def check_layout(root: Path) -> None:
    if not root.is_dir():
        _fail(f"{root}: checkpoint directory does not exist")
    for name in REQUIRED_ROOT_FILES:
        if not (root / name).is_file():
            _fail(f"{root / name}: missing (required by the MiniCPM-o 4.5 layout)")
    if not (root / "model.safetensors.index.json").is_file() and not (root / "model.safetensors").is_file():
        _fail(f"{root}: neither model.safetensors.index.json nor model.safetensors found")
    for name in TOKEN2WAV_FILES:
        if not (root / "assets" / "token2wav" / name).is_file():
            _fail(f"{root / 'assets' / 'token2wav' / name}: missing Code2Wav asset")
    if not (root / REF_AUDIO).is_file():
        _fail(f"{root / REF_AUDIO}: missing default reference voice")


# -------------------------------------------------------------------------------------------- config
def check_config(ckpt: Checkpoint, report: CheckReport) -> None:
    """Beyond the loader's own checks: the contract values that must not shrink (docs/model.md, Tiny
    checkpoint)."""
    cfg, path = ckpt.config, ckpt.root / "config.json"
    if cfg.get("model_type", "minicpmo") != "minicpmo":
        _fail(f"{path}: model_type is {cfg['model_type']!r}, expected 'minicpmo'")
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    if heads % kv:
        _fail(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    vc, ac, tts = ckpt.vision_config, ckpt.audio_config, ckpt.tts_config
    if int(vc["hidden_size"]) % int(vc["num_attention_heads"]):
        _fail(f"{path}: vision_config.hidden_size must be a multiple of vision_config.num_attention_heads")
    fixed = {
        "query_num": (cfg["query_num"], 64),
        "audio_config.num_mel_bins": (ac["num_mel_bins"], 80),
        "audio_config.max_source_positions": (ac["max_source_positions"], 1500),
        "tts_config.num_audio_tokens": (tts["num_audio_tokens"], CODEC_EOS_ID + 1),
        "tts_config.num_vq": (tts["num_vq"], 1),
        "tts_config.audio_bos_token_id": (tts["audio_bos_token_id"], SPECIAL_TOKEN_IDS["<focus>"]),
        "tts_config.text_eos_token_id": (tts["text_eos_token_id"], SPECIAL_TOKEN_IDS["</perception>"]),
    }
    for key, (got, want) in fixed.items():
        if int(got) != want:
            _fail(f"{path}: {key} is {got}, expected {want} (a contract value that does not shrink)")
    if int(tts["num_text_tokens"]) < MIN_VOCAB_SIZE:
        _fail(
            f"{path}: tts_config.num_text_tokens {tts['num_text_tokens']} < {MIN_VOCAB_SIZE} "
            "(the Talker indexes LLM token ids)"
        )
    report.add(
        "config",
        f"version {cfg['version']}, model_type {cfg.get('model_type')}, vocab_size {cfg['vocab_size']}",
    )
    report.add(
        "thinker LLM",
        f"{cfg['num_hidden_layers']} L x {cfg['hidden_size']} (FFN {cfg['intermediate_size']}, "
        f"{heads}q/{kv}kv heads x {cfg.get('head_dim', int(cfg['hidden_size']) // heads)})",
    )
    report.add(
        "vision / audio",
        f"SigLIP {vc['num_hidden_layers']} L x {vc['hidden_size']}, "
        f"Whisper {ac['encoder_layers']} L x {ac['d_model']}, query_num {cfg['query_num']}",
    )
    report.add(
        "talker",
        f"{tts['num_hidden_layers']} L x {tts['hidden_size']}, codec {tts['num_audio_tokens']}, "
        f"text table {tts['num_text_tokens']}",
    )


# ------------------------------------------------------------------------------------------- weights
def _hint(name: str) -> str:
    return next((hint for prefix, hint in _SHAPE_HINT if name.startswith(prefix)), "config.json")


def check_weights(ckpt: Checkpoint, report: CheckReport) -> None:
    """Prefix census, the SigLIP layer rule, and every tensor's shape against the config."""
    cfg = ckpt.config
    index_name = (
        "model.safetensors.index.json"
        if (ckpt.root / "model.safetensors.index.json").is_file()
        else "model.safetensors"
    )
    stray = sorted(n for n in ckpt.weight_map if not n.startswith(ALL_PREFIXES))
    if stray:
        _fail(
            f"{ckpt.root / index_name}: tensor {stray[0]!r} is outside the known prefixes {list(ALL_PREFIXES)} "
            f"({len(stray)} such tensors)"
        )
    for prefix in ALL_PREFIXES:
        if not any(n.startswith(prefix) for n in ckpt.weight_map):
            _fail(f"{ckpt.root / index_name}: no tensor with prefix {prefix!r}")

    vision_layers = int(cfg["vision_config"]["num_hidden_layers"])
    stored = {
        int(m.group(1)) for n in ckpt.weight_map if (m := re.match(r"vpm\.encoder\.layers\.(\d+)\.", n))
    }
    if stored != set(range(vision_layers - 1)) and stored != set(range(vision_layers)):
        _fail(
            f"{ckpt.root / index_name}: vpm.encoder.layers stores indices {sorted(stored)[:3]}..{max(stored, default=-1)}"
            f" ({len(stored)} layers); expected {vision_layers - 1} (last of {vision_layers} dropped) "
            f"or all {vision_layers}"
        )
    drop_note = "last dropped" if len(stored) == vision_layers - 1 else "all stored, last unused"

    expected = {s.name: s for s in all_specs(cfg)}
    if len(stored) == vision_layers:  # the unused last layer has the same layout as layer 0
        last = vision_layers - 1
        for spec in [s for s in expected.values() if s.name.startswith("vpm.encoder.layers.0.")]:
            name = spec.name.replace("vpm.encoder.layers.0.", f"vpm.encoder.layers.{last}.")
            expected[name] = TensorSpec(name, spec.shape)
    for name in sorted(expected):
        if name not in ckpt.weight_map:
            _fail(
                f"{ckpt.root / index_name}: missing tensor {name!r} (expected shape {list(expected[name].shape)} "
                f"from {_hint(name)})"
            )
    infos = ckpt.tensor_infos()
    for name, spec in expected.items():
        got = infos[name].shape
        if tuple(got) != tuple(spec.shape):
            _fail(
                f"{ckpt.root / infos[name].shard}: tensor {name!r} has shape {list(got)}, expected "
                f"{list(spec.shape)} (from {_hint(name)})"
            )
    extras = sorted(set(ckpt.weight_map) - set(expected))
    if extras:
        report.notes.append(
            f"{len(extras)} extra tensor(s) inside known prefixes, ignored by the loaders: "
            f"{', '.join(extras[:3])}{' ...' if len(extras) > 3 else ''}"
        )

    census: Counter[str] = Counter()
    params: Counter[str] = Counter()
    for name, info in infos.items():
        prefix = next(p for p in ALL_PREFIXES if name.startswith(p))
        census[prefix] += 1
        params[prefix] += int(np.prod(info.shape))
    dtypes = Counter(info.dtype for info in infos.values())
    shards = sorted(set(ckpt.weight_map.values()))
    report.add("shards", f"{len(shards)} ({shards[0]} ...), dtypes {dict(dtypes)}")
    for stage, prefixes in STAGE_PREFIXES.items():
        parts = ", ".join(f"{p}{census[p]} ({params[p] / 1e6:.1f} M)" for p in prefixes)
        report.add(f"census {stage}", parts)
    report.add("vision layers", f"{len(stored)} of {vision_layers} stored ({drop_note})")
    rows = infos["llm.model.embed_tokens.weight"].shape[0]
    report.add("tensors", f"{len(infos)} checked against config shapes; embed_tokens rows {rows}")


# ----------------------------------------------------------------------------------------- tokenizer
def check_tokenizer(ckpt: Checkpoint, report: CheckReport) -> None:
    tok = ckpt.tokenizer()  # asserts every special id of docs/model.md, Token ids
    where = ckpt.root / "tokenizer.json"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    if ids[0] != SPECIAL_TOKEN_IDS["<|im_start|>"] or ids[-1] != SPECIAL_TOKEN_IDS["<|im_end|>"]:
        _fail(
            f"{where}: '<|im_start|>user\\nhi<|im_end|>' encodes to {ids}; control tokens are not split out"
        )
    ids = tok.encode("(<image>./</image>)", add_special_tokens=False)
    if len(ids) != 5 or ids[1] != SPECIAL_TOKEN_IDS["<image>"] or ids[3] != SPECIAL_TOKEN_IDS["</image>"]:
        _fail(f"{where}: '(<image>./</image>)' encodes to {ids}, expected [?, 151669, ?, 151670, ?]")
    vocab_rows = int(ckpt.config["vocab_size"])
    if len(tok) > vocab_rows:
        _fail(
            f"{where}: {len(tok)} tokenizer entries but config.json vocab_size is {vocab_rows} "
            "(ids beyond the embedding table)"
        )
    tok_cfg = json.loads((ckpt.root / "tokenizer_config.json").read_text())
    bad = tok_cfg.get("bad_token_ids")
    if bad is not None and not (
        isinstance(bad, list) and all(isinstance(i, int) and 0 <= i < len(tok) for i in bad)
    ):
        _fail(
            f"{ckpt.root / 'tokenizer_config.json'}: bad_token_ids must be a list of token ids < {len(tok)}"
        )
    if not tok_cfg.get("chat_template"):
        report.notes.append("tokenizer_config.json has no chat_template")
    report.add(
        "tokenizer",
        f"{len(tok)} entries, {len(SPECIAL_TOKEN_IDS)} special ids OK, "
        f"bad_token_ids {len(bad) if bad is not None else 'absent'}",
    )
    gen = ckpt.generation_config
    eos = gen.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [eos]
    if SPECIAL_TOKEN_IDS["<|im_end|>"] not in eos_list:
        _fail(f"{ckpt.root / 'generation_config.json'}: eos_token_id {eos} must include 151645 (<|im_end|>)")
    pre = ckpt.preprocessor_config
    for key in ("max_slice_nums", "scale_resolution", "patch_size", "image_feature_size"):
        if key not in pre:
            _fail(f"{ckpt.root / 'preprocessor_config.json'}: missing key {key!r}")
    if int(pre["image_feature_size"]) != int(ckpt.config["query_num"]):
        _fail(
            f"{ckpt.root / 'preprocessor_config.json'}: image_feature_size {pre['image_feature_size']} != "
            f"config.json query_num {ckpt.config['query_num']}"
        )


# -------------------------------------------------------------------------------------------- assets
def _compare_state(path: Path, got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    for name, ref in want.items():
        if name not in got:
            _fail(f"{path}: missing tensor {name!r} (expected shape {list(ref.shape)})")
        if tuple(got[name].shape) != tuple(ref.shape):
            _fail(f"{path}: tensor {name!r} has shape {list(got[name].shape)}, expected {list(ref.shape)}")
    extra = sorted(set(got) - set(want))
    if extra:
        _fail(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} extra; loaders use strict=True)")


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # pickle/zip errors come in many types
        raise CheckpointError(f"{path}: cannot be loaded with torch.load(weights_only=True) ({exc})") from exc
    if not isinstance(state, dict):
        _fail(f"{path}: expected a state dict, got {type(state).__name__}")
    return state


def check_flow(d: Path, report: CheckReport) -> None:
    yaml_path = d / "flow.yaml"
    try:
        spec = load_flow_yaml(yaml_path, build=False)["flow"]
    except Exception as exc:  # yaml errors, unknown tags
        raise CheckpointError(
            f"{yaml_path}: does not parse with the safe flow loader (known tags {sorted(FLOW_TAGS)}): {exc}"
        ) from exc
    if (
        not isinstance(spec, dict)
        or spec.get("__class__") != "!new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec"
    ):
        _fail(f"{yaml_path}: 'flow' must be a !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec")
    dit = spec.get("decoder", {}).get("estimator", {})
    for key, want in DIT_FIXED.items():
        if dit.get(key) != want:
            _fail(
                f"{yaml_path}: flow.decoder.estimator.{key} is {dit.get(key)}, expected {want} "
                "(the streaming CFM scratch buffers are sized for it)"
            )
    if (
        spec.get("vocab_size") != CODEC_EOS_ID
        or spec.get("output_size") != 80
        or spec.get("spk_embed_dim") != 192
    ):
        _fail(
            f"{yaml_path}: flow vocab_size/output_size/spk_embed_dim must be {CODEC_EOS_ID}/80/192, got "
            f"{spec.get('vocab_size')}/{spec.get('output_size')}/{spec.get('spk_embed_dim')}"
        )
    with torch.device("meta"):
        flow = load_flow_yaml(yaml_path, build=True)["flow"]
    want = flow.state_dict()
    _compare_state(d / "flow.pt", _torch_load(d / "flow.pt"), want)
    enc = spec.get("encoder", {})
    report.add(
        "flow",
        f"{sum(t.numel() for t in want.values()) / 1e6:.1f} M params; encoder {enc.get('output_size')}-d "
        f"{enc.get('num_blocks')}+{enc.get('num_up_blocks')} blocks; DiT depth {dit.get('depth')}",
    )


def _parametrized_weight_norm_names(state: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Map legacy ``weight_g``/``weight_v`` keys to the parametrization names (torch converts them the same
    way when such a file is loaded into a parametrized module)."""
    renamed = {}
    legacy = False
    for key, value in state.items():
        for old, new in (
            (".weight_g", ".parametrizations.weight.original0"),
            (".weight_v", ".parametrizations.weight.original1"),
        ):
            if key.endswith(old):
                key, legacy = key[: -len(old)] + new, True
        renamed[key] = value
    return renamed, legacy


def check_hift(d: Path, report: CheckReport) -> None:
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator

    state = _torch_load(d / "hift.pt")
    prefixed = any(k.startswith("generator.") for k in state)
    state, legacy = _parametrized_weight_norm_names(
        {k.removeprefix("generator."): v for k, v in state.items()}
    )
    with torch.device("meta"):
        want = HiFTGenerator().state_dict()
    _compare_state(d / "hift.pt", state, want)
    report.add(
        "hift",
        f"{sum(t.numel() for t in want.values()) / 1e6:.1f} M params"
        f"{', generator.-prefixed' if prefixed else ''}{', legacy weight_g/weight_v' if legacy else ''}",
    )


def check_campplus(d: Path, report: CheckReport) -> None:
    import onnxruntime

    path = d / "campplus.onnx"
    try:
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        feats = np.random.default_rng(0).standard_normal((1, 120, 80)).astype(np.float32)
        out = sess.run(None, {sess.get_inputs()[0].name: feats})[0]
    except Exception as exc:
        raise CheckpointError(f"{path}: does not run in onnxruntime on a [1, T, 80] input ({exc})") from exc
    if tuple(out.shape) != (1, 192) or not np.isfinite(out).all():
        _fail(
            f"{path}: output shape {list(out.shape)} (finite={bool(np.isfinite(out).all())}), expected [1, 192]"
        )
    report.add("campplus.onnx", "runs: [1, T, 80] -> [1, 192]")


def check_speech_tokenizer(d: Path, report: CheckReport) -> None:
    """Harvest initializers the way s3tokenizer does, infer the dimensions, and match S3TokenizerV2."""
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2
    from s3tokenizer.utils import onnx2torch

    path = d / "speech_tokenizer_v2_25hz.onnx"
    try:
        state = onnx2torch(str(path), None, False)
    except Exception as exc:
        raise CheckpointError(
            f"{path}: initializers cannot be read by s3tokenizer's onnx2torch ({exc})"
        ) from exc
    conv1 = state.get("encoder.conv1.weight")
    if conv1 is None or conv1.dim() != 3:
        _fail(f"{path}: no conv1 weight (initializer onnx::Conv_2216) with shape [n_state, n_mels, 3]")
    n_state, n_mels = int(conv1.shape[0]), int(conv1.shape[1])
    blocks = len({m.group(1) for k in state if (m := re.match(r"encoder\.blocks\.(\d+)\.", k))})
    if n_mels != 128 or n_state % S3_HEAD_DIM:
        _fail(
            f"{path}: conv1 implies n_mels {n_mels} / width {n_state}; expected 128 mels and a width that is "
            f"a multiple of the fixed head_dim {S3_HEAD_DIM}"
        )
    cfg = ModelConfig(
        n_mels=n_mels, n_audio_state=n_state, n_audio_head=n_state // S3_HEAD_DIM, n_audio_layer=blocks
    )
    with torch.device("meta"):
        want = S3TokenizerV2("speech_tokenizer_v2_25hz", cfg).state_dict()
    _compare_state(path, state, want)
    size = "full size" if (n_state, blocks) == (1280, 6) else "reduced"
    report.add(
        "speech tokenizer",
        f"S3TokenizerV2 {n_state}-d, {n_state // S3_HEAD_DIM} heads, {blocks} blocks, {n_mels} mels ({size})",
    )


def check_ref_audio(root: Path, report: CheckReport) -> None:
    import soundfile as sf

    path = root / REF_AUDIO
    try:
        audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable audio file ({exc})") from exc
    seconds = audio.shape[0] / rate
    if seconds < 1.0 or not np.isfinite(audio).all() or float(np.abs(audio).max()) == 0.0:
        _fail(f"{path}: expected at least 1 s of non-silent audio, got {seconds:.2f} s")
    report.add("reference voice", f"{seconds:.3f} s @ {rate} Hz, {audio.shape[1]} channel(s)")


def check_assets(root: Path, report: CheckReport) -> None:
    d = root / "assets" / "token2wav"
    check_flow(d, report)
    check_hift(d, report)
    check_campplus(d, report)
    check_speech_tokenizer(d, report)
    check_ref_audio(root, report)


# ---------------------------------------------------------------------------------------------- main
def check_checkpoint(root: str | Path, *, load_assets: bool = True) -> CheckReport:
    """Run every check; raises :class:`CheckpointError` on the first violation."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    root = Path(root).expanduser().resolve()
    report = CheckReport(root)
    check_layout(root)
    ckpt = Checkpoint(root)  # version, required keys, weight index, shard presence
    check_config(ckpt, report)
    check_weights(ckpt, report)
    check_tokenizer(ckpt, report)
    if load_assets:
        check_assets(root, report)
    else:
        report.notes.append("token2wav assets present but not loaded (--skip-assets)")
    return report


def run_check(root: str | Path, *, load_assets: bool = True) -> int:
    print(f"minicpmo-checkpoint check {root}")
    try:
        report = check_checkpoint(root, load_assets=load_assets)
    except CheckpointError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    print("\n".join(report.lines))
    for note in report.notes:
        print(f"  note: {note}")
    print("OK: the checkpoint satisfies the MiniCPM-o 4.5 contract")
    return 0
