"""The code2wav stage loads its weights without building random ones first (a restart's start-up).

``load_token2wav`` builds flow and HiFT on the meta device and assigns the checkpoint's tensors (HiFT's
weight-norm pairs folded first); this must give exactly the modules the ordinary path gives (build with
random init and weight norm, load strictly, fold the weight norm): every parameter and buffer equal, no
tensor left on meta, and the same audio from the same mel.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from services.code2wav.model import loader
from services.code2wav.model.flow_yaml import load_flow_from_yaml
from services.common.checkpoint import Checkpoint


def _reference(asset_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    flow = load_flow_from_yaml(asset_dir / "flow.yaml")
    flow.load_state_dict(torch.load(asset_dir / "flow.pt", weights_only=True), strict=True)
    hift = loader.HiFTGenerator()
    state = loader.normalise_hift_keys(torch.load(asset_dir / "hift.pt", weights_only=True))
    hift.load_state_dict(state, strict=True)
    loader._fold_weight_norm(hift)
    return flow.eval(), hift.eval()


def test_fast_load_equals_the_ordinary_build(tiny_ckpt: Path) -> None:
    asset_dir = Checkpoint(tiny_ckpt).token2wav_dir
    start = time.perf_counter()
    fast = loader.load_token2wav(asset_dir, "cpu")
    fast_s = time.perf_counter() - start
    start = time.perf_counter()
    flow, hift = _reference(asset_dir)
    reference_s = time.perf_counter() - start
    print(f"FIGURE code2wav_load_s fast={fast_s:.2f} ordinary={reference_s:.2f}")
    for ours, theirs in ((fast.flow, flow), (fast.hift, hift)):
        assert not loader._meta_tensors(ours)
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert not any(hasattr(m, "parametrizations") for m in ours.modules())  # weight norm folded
    torch.manual_seed(0)
    mel = torch.randn(1, int(fast.hift.conv_pre.in_channels), 24)
    with torch.no_grad():
        torch.manual_seed(1)
        ours_wave = fast.hift(mel)[0]
        torch.manual_seed(1)
        ref_wave = hift(mel)[0]
    assert torch.equal(ours_wave, ref_wave)
