"""The talker's fused decode kernels against its torch decode path (Triton's interpreter on CPU).

The rotary + K/V store kernel (the thinker's, without q/k norms) must round exactly as the torch path does (bit-identical in a 16-bit
dtype and fp32); whole decode+sample steps over a batch bucket with idle rows must pick the same ids, write the
same cache rows and give logits within fp32 summation-order noise of the torch path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.talker import sampling as smp
from services.talker.fused_decode import select_backend
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import TalkerRunner

pytestmark = pytest.mark.usefixtures("triton_interpreter_scalars")


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> MiniCPMTTS:
    return MiniCPMTTS.from_checkpoint(Checkpoint(tiny_ckpt))


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    assert select_backend(cpu) == select_backend(cpu, "auto") == "torch"  # auto never picks the interpreter
    assert select_backend(cpu, "triton") == "triton"
    assert select_backend(cpu, "torch") == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        select_backend(cpu, "cuda-magic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_rounds_like_the_torch_path(dtype: torch.dtype) -> None:
    """fp16 stands in for bf16: Triton's interpreter (numpy) does not round bf16 casts to nearest."""
    from services.common.kernels import TorchOps
    from services.common.kernels.triton_ops import TritonOps

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, slots, rows = 4, 2, 16, 3, 9
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = (torch.randn(rows, d, generator=g).to(dtype) for _ in range(2))
    half = d // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # as the runner builds it
    pos = torch.tensor([0, 5, 2, 7])
    write_slot, write_index = torch.tensor([0, 2, 1, 2]), torch.tensor([0, 5, 8, 7])  # row 2: scratch (8)
    k_cache, v_cache = (torch.zeros(slots, rows, hkv, d, dtype=dtype) for _ in range(2))
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    tokens = write_slot * rows + write_index
    q = TritonOps.qk_rope_store(qkv, None, 0.0, cos, sin, pos, tokens, flat_k, flat_v, hq, hkv)

    heads = qkv.view(4, hq + 2 * hkv, d)
    qk = heads[:, : hq + hkv]
    qk = qk * cos[pos][:, None] + qk.roll(half, dims=-1) * sin_signed[pos][:, None]  # the runner's
    torch.testing.assert_close(q, qk[:, :hq], rtol=0, atol=0)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[write_slot, write_index] = qk[:, hq:]
    want_v[write_slot, write_index] = heads[:, hq + hkv :]
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)
    # the torch reference of the same op without q/k norms agrees too (the thinker's CPU fallback)
    ref_k, ref_v = torch.zeros_like(flat_k), torch.zeros_like(flat_v)
    q_ref = TorchOps.qk_rope_store(qkv, None, 0.0, cos, sin, pos, tokens, ref_k, ref_v, hq, hkv)
    torch.testing.assert_close(q_ref, q, rtol=0, atol=0)
    torch.testing.assert_close(ref_k, flat_k, rtol=0, atol=0)
    torch.testing.assert_close(ref_v, flat_v, rtol=0, atol=0)


def test_fused_decode_sample_matches_the_torch_path(model: MiniCPMTTS) -> None:
    """Seeded sampling over slots 1 and 2 of a 4-row bucket (rows 0 and 3 idle): same ids and cache."""
    runners = {k: TalkerRunner(model, num_slots=4, kernels=k) for k in ("torch", "triton")}
    assert runners["triton"]._fused is not None and runners["torch"]._fused is None
    conds = [model.whole_utterance_condition(*_condition(model, n, 50 + n)) for n in (5, 8)]
    slots = [1, 2]
    vocab = model.cfg.num_audio_tokens
    states = {k: [smp.RowState(smp.SamplingParams(0.8, 0.85, 25, 1.05, s)) for s in (3, 4)] for k in runners}
    codes = {k: [21, 22] for k in runners}
    for runner in runners.values():
        for s, c in zip(slots, conds, strict=True):
            runner.cache.lengths[s] = 0
            runner.prefill(s, c)
    for t in range(6):
        rule = smp.whole_utterance_rules(t + 1, 50)
        out = {}
        for k, runner in runners.items():
            packed = [smp.pack_row(r, rule, vocab) for r in states[k]]
            out[k] = runner.decode_sample(slots, codes[k], packed, want_logits=True)
            for r, code in zip(states[k], out[k][0], strict=True):
                r.remember(code)
            codes[k] = out[k][0]
        assert out["triton"][0] == out["torch"][0]
        torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-5, atol=1e-5)
    a, b = runners["torch"].cache, runners["triton"].cache
    assert a.lengths == b.lengths
    for s in slots:
        n = a.lengths[s]
        torch.testing.assert_close(b.k[:, s, :n], a.k[:, s, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.v[:, s, :n], a.v[:, s, :n], rtol=1e-5, atol=1e-6)


def _condition(model: MiniCPMTTS, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n,), generator=gen), torch.randn(n, model.cfg.llm_dim, generator=gen)
