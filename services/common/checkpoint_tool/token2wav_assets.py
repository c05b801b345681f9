"""Code2Wav assets: ``assets/token2wav/{flow.yaml, flow.pt, hift.pt, campplus.onnx,
speech_tokenizer_v2_25hz.onnx}`` and ``assets/HT_ref_audio.wav`` (docs/model.md, Code2Wav and Tiny
checkpoint).

* flow: the yaml uses the same four constructor tags as the real file; the module is built from the yaml
  with the stepaudio2 classes (on the ``meta`` device, so only names and shapes are produced), then every
  tensor is drawn by the same seeded rules as the safetensors. ``tiny`` shrinks the conformer encoder and
  the DiT depth but keeps the DiT at hidden 512 / 8 heads / head_dim 64, because stepaudio2's streaming
  path writes into fixed-size scratch buffers of those widths.
* hift: always the full-size ``HiFTGenerator`` (it has no config file; loaders hard-code its shape), keys
  ``generator.``-prefixed as in the real file; the f0 and output heads are re-scaled so the random vocoder
  is audible and unclipped (see ``_make_hift_audible``).
* campplus.onnx: a small valid graph, [1, T, 80] fbank -> [1, 192] embedding, that onnxruntime executes.
* speech_tokenizer_v2_25hz.onnx: a weights-only ONNX laid out the way ``s3tokenizer.utils.onnx2torch``
  harvests initializers (that is all s3tokenizer ever does with the real file). ``tiny``: 128-d, 2 heads,
  2 blocks; ``full``: the real 1280-d, 20 heads, 6 blocks.
* HT_ref_audio.wav: 6.0 s of synthetic, speech-like audio (voiced syllables through vowel formants,
  fricative noise, pauses), 16 kHz mono PCM_16.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from .weights import TensorSpec, make_tensor, print_progress

FLOW_TAGS: dict[str, tuple[str, str]] = {
    "!new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": (
        "stepaudio2.cosyvoice2.flow.flow",
        "CausalMaskedDiffWithXvec",
    ),
    "!new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2": (
        "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
        "UpsampleConformerEncoderV2",
    ),
    "!new:cosyvoice2.flow.flow_matching.CausalConditionalCFM": (
        "stepaudio2.cosyvoice2.flow.flow_matching",
        "CausalConditionalCFM",
    ),
    "!new:cosyvoice2.flow.decoder_dit.DiT": ("stepaudio2.cosyvoice2.flow.decoder_dit", "DiT"),
}

# (encoder width, blocks, up-blocks, heads, FFN, DiT depth) per size; the DiT width is fixed (see above).
FLOW_DIMS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 1, 1, 2, 128, 2),
    "full": (512, 6, 4, 8, 2048, 16),
}
S3_DIMS: dict[str, tuple[int, int, int]] = {
    "tiny": (128, 2, 2),
    "full": (1280, 20, 6),
}  # width, heads, blocks
CAMPPLUS_HIDDEN = 256
REF_AUDIO_RATE = 16000
REF_AUDIO_SECONDS = 6.0


# ------------------------------------------------------------------------------------------ flow.yaml
def flow_yaml_text(size: str) -> str:
    width, blocks, up_blocks, heads, ffn, depth = FLOW_DIMS[size]
    return f"""# Step-Audio2 token2wav flow model ({size} random-weight stand-in; same tags and keys as the real file).
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {width}
    output_size: 80
    spk_embed_dim: 192
    output_type: 'mel'
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {width}
        output_size: {width}
        input_layer: 'linear'
        pre_lookahead_len: 3
        num_blocks: {blocks}
        num_up_blocks: {up_blocks}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: {heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: true
        linear_units: {ffn}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: 4.0
            depth: {depth}
            num_heads: 8
            head_dim: 64
            hidden_size: 512
"""


def load_flow_yaml(path: Path, *, build: bool) -> dict[str, Any]:
    """Parse ``flow.yaml`` with a safe loader that knows only the four flow tags.

    ``build=False`` turns each tagged mapping into ``{"__class__": tag, **kwargs}`` (no imports, used by the
    checker to read dimensions); ``build=True`` instantiates the stepaudio2 classes. Any other tag is a
    ``yaml.constructor.ConstructorError``, so a yaml cannot execute arbitrary constructors.
    """
    import importlib

    class FlowLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml ships no type information here (Any)
        pass

    def constructor_for(tag: str) -> Callable[[yaml.SafeLoader, yaml.Node], Any]:
        def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
            kwargs = loader.construct_mapping(node, deep=True)
            if not build:
                return {"__class__": tag, **kwargs}
            module_name, cls_name = FLOW_TAGS[tag]
            return getattr(importlib.import_module(module_name), cls_name)(**kwargs)

        return construct

    for tag in FLOW_TAGS:
        FlowLoader.add_constructor(tag, constructor_for(tag))
    data = yaml.load(Path(path).read_text(), Loader=FlowLoader)  # noqa: S506 - SafeLoader subclass
    if not isinstance(data, dict) or "flow" not in data:
        raise ValueError(f"{path}: expected a mapping with a top-level 'flow' key")
    return data


# ------------------------------------------------------------------------------------ torch state dicts
def _state_specs(module: torch.nn.Module) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape)) for k, v in module.state_dict().items()]


def _materialise(specs: list[TensorSpec], seed: int, file: str, device: str) -> dict[str, torch.Tensor]:
    return {s.name: make_tensor(seed, file, s, device=device).cpu() for s in specs}


def write_flow(out: Path, size: str, seed: int, device: str) -> int:
    (out / "flow.yaml").write_text(flow_yaml_text(size))
    with torch.device("meta"):
        flow = load_flow_yaml(out / "flow.yaml", build=True)["flow"]
    specs = _state_specs(flow)
    torch.save(_materialise(specs, seed, "flow.pt", device), out / "flow.pt")
    return sum(int(np.prod(s.shape)) for s in specs)


def write_hift(out: Path, seed: int, device: str) -> int:
    from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator

    with torch.device("meta"):
        hift = HiFTGenerator()
    specs = [TensorSpec("generator." + s.name, s.shape) for s in _state_specs(hift)]
    state = _materialise(specs, seed, "hift.pt", device)
    _make_hift_audible(state)
    torch.save(state, out / "hift.pt")
    return sum(int(np.prod(s.shape)) for s in specs)


# n_fft // 2 + 1 = 9 log-magnitude channels come first in conv_post's output, then 9 phase channels.
_HIFT_MAGNITUDE_CHANNELS = 9


def _make_hift_audible(state: dict[str, torch.Tensor]) -> None:
    """Re-scale two heads so a random HiFT produces usable audio instead of a clipped square wave.

    With the generic init the f0 head predicts |N(0, ~1)| Hz (the sine source is silent) and conv_post's
    log-magnitudes are O(1-10), so exp() saturates and ~70 % of samples hit the +-0.99 clamp. Here the f0
    head is centred on 200 Hz (spread ~20-30 Hz) and conv_post is damped with the magnitudes biased down,
    which gives an rms around 0.13 with (almost) no clipped samples on random mels.
    """
    p = "generator."
    state[p + "f0_predictor.classifier.weight"] *= 40.0
    state[p + "f0_predictor.classifier.bias"] = torch.full_like(
        state[p + "f0_predictor.classifier.bias"], 200.0
    )
    state[p + "conv_post.parametrizations.weight.original0"] *= 0.25
    state[p + "conv_post.bias"][:_HIFT_MAGNITUDE_CHANNELS] -= 0.5


# ----------------------------------------------------------------------------------------- ONNX files
def _np(seed: int, file: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return make_tensor(seed, file, TensorSpec(name, shape)).numpy()


def write_campplus(path: Path, seed: int) -> None:
    """[1, T, 80] -> tanh(x W1 + b1) -> mean over T -> (W2, b2) -> [1, 192].

    The tanh matters: fbank features arrive mean-normalised over time, so a linear map followed by the mean
    would return (almost) the bias for every speaker.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    file = "campplus.onnx"
    inits = [
        numpy_helper.from_array(_np(seed, file, "hidden.weight", (80, CAMPPLUS_HIDDEN)), "hidden.weight"),
        numpy_helper.from_array(_np(seed, file, "hidden.bias", (CAMPPLUS_HIDDEN,)), "hidden.bias"),
        numpy_helper.from_array(_np(seed, file, "embed.weight", (CAMPPLUS_HIDDEN, 192)), "embed.weight"),
        numpy_helper.from_array(_np(seed, file, "embed.bias", (192,)), "embed.bias"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "time_axis"),
    ]
    nodes = [
        helper.make_node("MatMul", ["feats", "hidden.weight"], ["h0"], name="hidden/MatMul"),
        helper.make_node("Add", ["h0", "hidden.bias"], ["h1"], name="hidden/Add"),
        helper.make_node("Tanh", ["h1"], ["h2"], name="hidden/Tanh"),
        helper.make_node("ReduceMean", ["h2", "time_axis"], ["pooled"], name="pool/ReduceMean", keepdims=0),
        helper.make_node("MatMul", ["pooled", "embed.weight"], ["e0"], name="embed/MatMul"),
        helper.make_node("Add", ["e0", "embed.bias"], ["embs"], name="embed/Add"),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embs", TensorProto.FLOAT, [1, 192])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="minicpmo-checkpoint"
    )
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


# Initializer names under which s3tokenizer's onnx2torch recognises the V2 convolutions and FSQ projection.
_S3_FIXED_NAMES = {
    "encoder.conv1.weight": "onnx::Conv_2216",
    "encoder.conv1.bias": "onnx::Conv_2217",
    "encoder.conv2.weight": "onnx::Conv_2218",
    "encoder.conv2.bias": "onnx::Conv_2219",
    "quantizer._codebook.project_down.weight": "onnx::MatMul_2536",
    "quantizer._codebook.project_down.bias": "quantizer.project_in.bias",
}


def s3_state_specs(size: str) -> list[TensorSpec]:
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    width, heads, blocks = S3_DIMS[size]
    with torch.device("meta"):
        model = S3TokenizerV2(
            "speech_tokenizer_v2_25hz",
            ModelConfig(n_audio_state=width, n_audio_head=heads, n_audio_layer=blocks),
        )
    return _state_specs(model)


def _s3_node_for(name: str) -> tuple[str, str]:
    """(op_type, node name) whose initializer input onnx2torch maps back to torch parameter ``name``."""
    if name.startswith("encoder.conv1."):
        return "Conv", "/conv1/Conv"
    if name.startswith("encoder.conv2."):
        return "Conv", "/conv2/Conv"
    if name.startswith("quantizer."):
        return (
            ("MatMul", "/quantizer/project_down/MatMul")
            if name.endswith("weight")
            else ("Add", "/quantizer/project_down/Add")
        )
    # encoder.blocks.{i}.{path}.{weight|bias}
    _, _, idx, *path, leaf = name.split(".")
    module = "/".join(path)
    if module.endswith("_ln"):
        return "LayerNormalization", f"/blocks.{idx}/{module}/LayerNormalization"
    if module == "attn/fsmn_block":
        return "Conv", f"/blocks.{idx}/attn/fsmn_block/Conv"
    if module.startswith("mlp/"):
        module = "mlp/mlp." + module.split("/")[1]
    return (
        "MatMul" if leaf == "weight" else "Add"
    ), f"/blocks.{idx}/{module}/{'MatMul' if leaf == 'weight' else 'Add'}"


def write_speech_tokenizer(path: Path, size: str, seed: int) -> int:
    """Weights-only ONNX: one node per weight, chained so the graph is well formed (it is never executed)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    file = "speech_tokenizer_v2_25hz.onnx"
    specs = s3_state_specs(size)
    by_node: dict[str, dict[str, Any]] = {}
    initializers = []
    for spec in specs:
        arr = _np(seed, file, spec.name, spec.shape)
        if arr.ndim == 2:
            arr = np.ascontiguousarray(arr.T)  # onnx2torch transposes 2-D initializers back
        init_name = _S3_FIXED_NAMES.get(spec.name, spec.name)
        initializers.append(numpy_helper.from_array(arr, init_name))
        op, node_name = _s3_node_for(spec.name)
        entry = by_node.setdefault(node_name, {"op": op, "weights": {}})
        entry["weights"][spec.name.rsplit(".", 1)[1]] = init_name
    nodes = []
    prev = "mel"
    for i, (node_name, entry) in enumerate(by_node.items()):
        w = entry["weights"]
        if entry["op"] == "LayerNormalization":
            inputs = [prev, w["weight"], w["bias"]]
        else:
            inputs = [prev, *w.values()]
        nodes.append(helper.make_node(entry["op"], inputs, [f"t{i}"], name=node_name))
        prev = f"t{i}"
    graph = helper.make_graph(
        nodes,
        "s3tokenizer_v2_weights",
        [helper.make_tensor_value_info("mel", TensorProto.FLOAT, [1, 128, "T"])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)],
        initializer=initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="minicpmo-checkpoint"
    )
    model.ir_version = 9
    onnx.save(model, str(path))
    return sum(int(np.prod(s.shape)) for s in specs)


# --------------------------------------------------------------------------------------- reference wav
_VOWEL_FORMANTS = (
    (730, 1090, 2440),
    (270, 2290, 3010),
    (300, 870, 2240),
    (530, 1840, 2480),
    (570, 840, 2410),
)


def _resonate(x: np.ndarray, freq: float, bandwidth: float, rate: int) -> np.ndarray:
    from scipy.signal import lfilter

    r = np.exp(-np.pi * bandwidth / rate)
    a = [1.0, -2 * r * np.cos(2 * np.pi * freq / rate), r * r]
    out: np.ndarray = lfilter([1.0 - r], a, x)
    return out


def synth_reference_audio(
    seed: int, rate: int = REF_AUDIO_RATE, seconds: float = REF_AUDIO_SECONDS
) -> np.ndarray:
    """Syllables of a harmonic glottal source shaped by vowel formants, fricative bursts and short pauses."""
    rng = np.random.default_rng(seed)
    total = int(round(rate * seconds))
    out = np.zeros(total)
    pos = int(0.15 * rate)
    while pos < total - int(0.2 * rate):
        dur = int(rate * rng.uniform(0.14, 0.32))
        n = min(dur, total - pos)
        t = np.arange(n) / rate
        if rng.random() < 0.2:  # fricative: band-limited noise
            seg = _resonate(rng.standard_normal(n), rng.uniform(3000, 5000), 1500.0, rate) * 0.3
        else:
            f0 = (
                rng.uniform(105, 160)
                * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1, 3) * t))
                * np.linspace(1.05, 0.92, n)
            )
            phase = 2 * np.pi * np.cumsum(f0) / rate
            source = sum((np.sin(k * phase) / k for k in range(1, 40)), np.zeros(n))  # start: an array, not 0
            seg = np.zeros(n)
            for freq, gain in zip(
                _VOWEL_FORMANTS[rng.integers(len(_VOWEL_FORMANTS))], (1.0, 0.6, 0.3), strict=True
            ):
                seg += gain * _resonate(source, freq, 90.0, rate)
            seg += 0.01 * rng.standard_normal(n)
        seg *= np.sin(np.pi * np.arange(n) / n) ** 0.6  # syllable envelope
        out[pos : pos + n] += seg
        pos += n + (int(rate * rng.uniform(0.08, 0.25)) if rng.random() < 0.3 else int(0.02 * rate))
    out += 0.002 * rng.standard_normal(total)  # room noise floor
    wave: np.ndarray = (0.5 * out / np.max(np.abs(out))).astype(np.float32)
    return wave


def write_reference_audio(path: Path, seed: int) -> None:
    import soundfile as sf

    # libsndfile's own float -> PCM_16 writer (scale 32767), not services.common.audio's (32768): it keeps
    # the generated file byte-identical for GENERATOR_VERSION 1, so checkpoints made before still match.
    sf.write(str(path), synth_reference_audio(seed), REF_AUDIO_RATE, subtype="PCM_16")


def write_token2wav_assets(
    root: Path, size: str, seed: int, device: str, log: Callable[[str], None] = print_progress
) -> None:
    out = root / "assets" / "token2wav"
    out.mkdir(parents=True, exist_ok=True)
    n = write_flow(out, size, seed, device)
    log(f"  flow.yaml + flow.pt: {n / 1e6:.1f} M params")
    n = write_hift(out, seed, device)
    log(f"  hift.pt: {n / 1e6:.1f} M params (full-size HiFT)")
    write_campplus(out / "campplus.onnx", seed)
    n = write_speech_tokenizer(out / "speech_tokenizer_v2_25hz.onnx", size, seed)
    log(f"  campplus.onnx + speech_tokenizer_v2_25hz.onnx ({n / 1e6:.1f} M params, {S3_DIMS[size]})")
    write_reference_audio(root / "assets" / "HT_ref_audio.wav", seed)
    log(f"  HT_ref_audio.wav: {REF_AUDIO_SECONDS} s @ {REF_AUDIO_RATE} Hz")
