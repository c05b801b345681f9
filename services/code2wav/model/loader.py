"""Load the Code2Wav weights (flow + HiFT) from a checkpoint's ``assets/token2wav`` folder.

Device-agnostic on purpose: the stepaudio2 wheel's own ``Token2wav`` hard-codes ``.cuda()``; here every
module is built on CPU, loaded strictly, then moved with ``.to(device)`` so the same code serves the CPU
test fixture and the GPU host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from stepaudio2.cosyvoice2.flow.flow import CausalMaskedDiffWithXvec
from stepaudio2.flashcosyvoice.modules.hifigan import HiFTGenerator
from torch.nn.utils import parametrize

from services.code2wav.model.flow_yaml import load_flow_from_yaml
from services.common.checkpoint import Checkpoint


class Token2WavLoadError(ValueError):
    """A token2wav asset is missing or does not match the modules it should load into."""


@dataclass(frozen=True)
class FlowDims:
    """Shapes the streaming caches are sized from (read from the built modules, never assumed)."""

    encoder_layers: int  # first conformer stack + up conformer stack
    encoder_heads: int
    encoder_head_dim: int
    encoder_channels: int
    lookahead: int  # pre-lookahead tokens stripped from every non-final window
    up_rate: int  # mel frames per codec token
    dit_depth: int
    dit_heads: int
    dit_head_dim: int
    dit_hidden: int
    mel_bins: int
    vocab_size: int
    cfg_rate: float


def _flow_dims(flow: CausalMaskedDiffWithXvec) -> FlowDims:
    enc = flow.encoder
    att = enc.encoders[0].self_attn
    dit = flow.decoder.estimator
    dit_att = dit.blocks[0].attn
    return FlowDims(
        encoder_layers=len(enc.encoders) + len(enc.up_encoders),
        encoder_heads=int(att.h),
        encoder_head_dim=int(att.d_k),
        encoder_channels=int(enc.output_size()),
        lookahead=int(flow.pre_lookahead_len),
        up_rate=int(flow.up_rate),
        dit_depth=len(dit.blocks),
        dit_heads=int(dit_att.num_heads),
        dit_head_dim=int(dit_att.head_dim),
        dit_hidden=int(dit.in_proj.out_features),
        mel_bins=int(flow.output_size),
        vocab_size=int(flow.vocab_size),
        cfg_rate=float(flow.decoder.inference_cfg_rate),
    )


def normalise_hift_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the optional ``generator.`` prefix and map legacy weight-norm names to parametrizations."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("generator."):
            key = key[len("generator.") :]
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


def fold_hift_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight-norm pairs of a (normalised) HiFT state dict folded into plain ``weight`` tensors.

    ``weight = g * v / ||v||`` over every dim but 0, which is what ``torch.nn.utils.parametrizations.
    weight_norm`` (dim 0, the default HiFT uses) computes and what :func:`_fold_weight_norm` leaves behind.
    """
    out: dict[str, torch.Tensor] = {}
    suffix_g, suffix_v = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
    for key, value in state.items():
        if key.endswith(suffix_g):
            base = key[: -len(suffix_g)]
            out[base + ".weight"] = torch._weight_norm(state[base + suffix_v], value, 0)
        elif not key.endswith(suffix_v):
            out[key] = value
    return out


@contextlib.contextmanager
def _plain_hift_modules() -> Iterator[None]:
    """Build HiFT without weight norm and without its random init: the weights come from the checkpoint
    (folded by :func:`fold_hift_state`), so both would only cost start-up time. The vocoder's modules are
    the same otherwise; on a loaded CPU host this takes the HiFT build from ~17 s to well under one."""
    from stepaudio2.flashcosyvoice.modules import hifigan
    from stepaudio2.flashcosyvoice.modules.hifigan_components import layers

    def identity(module: torch.nn.Module, *_: Any, **__: Any) -> torch.nn.Module:
        return module

    def no_init(_module: torch.nn.Module, *_: Any, **__: Any) -> None:
        return None

    saved = [
        (mod, name, getattr(mod, name))
        for mod in (hifigan, layers)
        for name in ("weight_norm", "init_weights")
    ]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, identity if name == "weight_norm" else no_init)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _meta_tensors(module: torch.nn.Module) -> list[str]:
    """Names of parameters, buffers and tensor attributes of ``module`` still on the meta device."""
    names = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    for prefix, sub in module.named_modules():
        names += [f"{prefix}.{k}" for k, v in vars(sub).items() if isinstance(v, torch.Tensor) and v.is_meta]
    return names


def load_without_init(
    build: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor]
) -> torch.nn.Module:
    """``build()`` with ``state`` loaded strictly, without paying for the random init of its weights.

    The module is built on the meta device (no storage, no init) and the checkpoint's tensors are
    assigned in place of its parameters, so a restart costs the read of the weights (from the page
    cache after the first start), not the init of weights that are overwritten at once. A module that
    keeps a tensor the state dict does not hold (it would be left on meta) is built the ordinary way.
    """
    with torch.device("meta"):
        module = build()
    module.load_state_dict(state, strict=True, assign=True)
    if _meta_tensors(module):
        module = build()
        module.load_state_dict(state, strict=True)
    return module


def build_hift(state: dict[str, torch.Tensor]) -> HiFTGenerator:
    """HiFT with ``state`` (a ``hift.pt`` as saved, weight-norm pairs or already folded) loaded strictly."""
    with _plain_hift_modules():
        hift = load_without_init(HiFTGenerator, fold_hift_state(normalise_hift_keys(state)))
    assert isinstance(hift, HiFTGenerator)
    return hift


def _fold_weight_norm(module: torch.nn.Module) -> None:
    """Replace weight-norm parametrizations by the weights they compute (same values, fewer kernels)."""
    for sub in module.modules():
        if parametrize.is_parametrized(sub):
            parametrizations: Any = sub.parametrizations
            for name in list(parametrizations.keys()):
                parametrize.remove_parametrizations(sub, name, leave_parametrized=True)


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise Token2WavLoadError(f"missing token2wav asset {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class Token2WavModel:
    """The flow (token -> mel) and HiFT (mel -> 24 kHz wave) modules on one device, in eval mode."""

    flow: CausalMaskedDiffWithXvec
    hift: HiFTGenerator
    dims: FlowDims
    device: torch.device
    asset_dir: Path

    @property
    def sample_rate(self) -> int:
        return int(self.hift.sampling_rate)

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz / 50 Hz)."""
        return int(self.hift.f0_upsamp.scale_factor)


def load_token2wav(asset_dir: str | Path, device: str | torch.device = "cpu") -> Token2WavModel:
    """Build flow + HiFT from ``asset_dir`` (``flow.yaml``, ``flow.pt``, ``hift.pt``) on ``device``."""
    asset_dir = Path(asset_dir)
    device = torch.device(device)
    flow_yaml = asset_dir / "flow.yaml"
    try:
        flow = load_without_init(lambda: load_flow_from_yaml(flow_yaml), _torch_load(asset_dir / "flow.pt"))
        assert isinstance(flow, CausalMaskedDiffWithXvec)
    except RuntimeError as exc:
        raise Token2WavLoadError(f"{asset_dir / 'flow.pt'} does not match flow.yaml: {exc}") from exc
    try:
        hift = build_hift(_torch_load(asset_dir / "hift.pt"))
    except (RuntimeError, KeyError) as exc:
        raise Token2WavLoadError(f"{asset_dir / 'hift.pt'} does not match HiFTGenerator: {exc}") from exc
    flow = flow.to(device).eval()
    hift = hift.to(device).eval()
    # A plain attribute, not a buffer: .to() does not move it and decode() would copy it every call.
    hift.stft_window = hift.stft_window.to(device)
    return Token2WavModel(flow=flow, hift=hift, dims=_flow_dims(flow), device=device, asset_dir=asset_dir)


def load_from_checkpoint(checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> Token2WavModel:
    """Load through the checkpoint contract so the token2wav folder is found and validated in one place."""
    return load_token2wav(Checkpoint(checkpoint_dir).token2wav_dir, device)
