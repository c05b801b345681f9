"""Load the Code2Wav weights (flow + HiFT) from a checkpoint's ``assets/token2wav`` folder.

Device-agnostic on purpose: the stepaudio2 wheel's own ``Token2wav`` hard-codes ``.cuda()``; here every
module is built on CPU, loaded strictly, then moved with ``.to(device)`` so the same code serves the CPU
test fixture and the GPU host.
"""

from __future__ import annotations

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
    flow = load_flow_from_yaml(asset_dir / "flow.yaml")
    try:
        flow.load_state_dict(_torch_load(asset_dir / "flow.pt"), strict=True)
    except RuntimeError as exc:
        raise Token2WavLoadError(f"{asset_dir / 'flow.pt'} does not match flow.yaml: {exc}") from exc
    hift = HiFTGenerator()
    try:
        hift.load_state_dict(normalise_hift_keys(_torch_load(asset_dir / "hift.pt")), strict=True)
    except RuntimeError as exc:
        raise Token2WavLoadError(f"{asset_dir / 'hift.pt'} does not match HiFTGenerator: {exc}") from exc
    _fold_weight_norm(hift)
    flow = flow.to(device).eval()
    hift = hift.to(device).eval()
    # A plain attribute, not a buffer: .to() does not move it and decode() would copy it every call.
    hift.stft_window = hift.stft_window.to(device)
    return Token2WavModel(flow=flow, hift=hift, dims=_flow_dims(flow), device=device, asset_dir=asset_dir)


def load_from_checkpoint(checkpoint_dir: str | Path, device: str | torch.device = "cpu") -> Token2WavModel:
    """Load through the checkpoint contract so the token2wav folder is found and validated in one place."""
    return load_token2wav(Checkpoint(checkpoint_dir).token2wav_dir, device)
