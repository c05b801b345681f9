"""The fused decoder kernels (services.common.kernels) against their torch reference, on CPU.

The Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``), so the kernel code itself
is what is tested, not a stand-in. The interpreter has no bfloat16 arithmetic of its own, so kernels are
checked in fp32 and fp16 here; bf16 on the GPU is compared with the torch path by ``bench.cuda_smoke``.
The thinker's engine on these kernels is tested in ``test_thinker_triton_engine.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU
triton = pytest.importorskip("triton")

from services.common.kernels import AttentionTiles, TorchOps, scale_rows_ref, select_backend  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_scalars(triton_interpreter_scalars: None) -> None:
    """Every test here runs the kernels through the interpreter (see ``conftest.py``)."""


def _triton_ops():  # noqa: ANN202
    from services.common.kernels.triton_ops import TritonOps

    return TritonOps


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_gate_and_rope_kernels_match_reference(dtype: torch.dtype) -> None:
    tri = _triton_ops()
    g = torch.Generator().manual_seed(0)
    x, d = (torch.randn(5, 128, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(128, generator=g).to(dtype)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(tri.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6), **tol)
    for got, want in zip(tri.add_rms_norm(x, d, w, 1e-6), TorchOps.add_rms_norm(x, d, w, 1e-6), strict=True):
        torch.testing.assert_close(got, want, **tol)
    gu = torch.randn(5, 512, generator=g).to(dtype)
    torch.testing.assert_close(tri.silu_mul(gu), TorchOps.silu_mul(gu), **tol)

    hq, hkv, dim = 4, 2, 32
    qkv = torch.randn(6, (hq + 2 * hkv) * dim, generator=g).to(dtype)
    wn = torch.randn(hq + hkv, dim, generator=g).to(dtype)
    cos, sin = (torch.randn(100, dim, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor([3, 7, 9, 10, 50, 2])
    slots = torch.tensor([17, 18, 40, 41, 5, 33])
    caches = [[torch.zeros(64, hkv, dim, dtype=dtype) for _ in range(2)] for _ in range(2)]
    qa = TorchOps.qk_rope_store(qkv, wn, 1e-6, cos, sin, pos, slots, *caches[0], hq, hkv)
    qb = tri.qk_rope_store(qkv, wn, 1e-6, cos, sin, pos, slots, *caches[1], hq, hkv)
    torch.testing.assert_close(qb, qa, **tol)
    torch.testing.assert_close(caches[1][0], caches[0][0], **tol)  # K written at the slots, normed + rotated
    torch.testing.assert_close(caches[1][1], caches[0][1], rtol=0, atol=0)  # V copied as is
    assert caches[1][0][slots].abs().sum() > 0 and caches[1][0][0].abs().sum() == 0

    # With a folded norm (``rms_of``): rows scaled by a residual row's 1/RMS first. One ulp in fp16: the
    # row statistics are summed in another fp32 order than torch's mean. 80 columns: a masked tail.
    x = (3 * torch.randn(6, 80, generator=g)).to(dtype)
    stol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    got = tri.silu_mul(gu, rms_of=(x[:5], 1e-6))
    torch.testing.assert_close(got, TorchOps.silu_mul(gu, rms_of=(x[:5], 1e-6)), **stol)
    assert not torch.allclose(got, TorchOps.silu_mul(gu), atol=1e-2)  # the scale was applied
    caches = [[torch.zeros(64, hkv, dim, dtype=dtype) for _ in range(2)] for _ in range(2)]
    qa = TorchOps.qk_rope_store(qkv, wn, 1e-6, cos, sin, pos, slots, *caches[0], hq, hkv, (x, 1e-6))
    qb = tri.qk_rope_store(qkv, wn, 1e-6, cos, sin, pos, slots, *caches[1], hq, hkv, (x, 1e-6))
    torch.testing.assert_close(qb, qa, **stol)
    for got_c, want_c in zip(caches[1], caches[0], strict=True):  # K scaled, normed, rotated; V scaled
        torch.testing.assert_close(got_c, want_c, **stol)
    v_scaled = scale_rows_ref(qkv, (x, 1e-6))[:, (hq + hkv) * dim :].reshape(6, hkv, dim)
    torch.testing.assert_close(caches[0][1][slots], v_scaled, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_paged_attention_matches_reference(dtype: torch.dtype, splits: int) -> None:
    """A decode row and a 40-token prefill chunk cut into 16-row tiles, scattered over pages."""
    tri = _triton_ops()
    g = torch.Generator().manual_seed(1)
    hq, hkv, dim, page = 4, 2, 32, 16
    k_cache, v_cache = (torch.randn(16 * page, hkv, dim, generator=g).to(dtype) for _ in range(2))
    table = torch.tensor([[3, 5, 7, 1, 0, 0], [2, 4, 6, 8, 9, 10]])
    q = torch.randn(41, hq, dim, generator=g).to(dtype)
    tiles = [(0, 1, 0, 50)] + [(1 + k, min(16, 40 - k), 1, 30 + k) for k in range(0, 40, 16)]
    meta = torch.tensor(tiles).t().contiguous()
    spec = AttentionTiles(meta[0], meta[1], meta[2], meta[3], table, page, 16, splits)
    want = TorchOps.paged_attention(q, k_cache, v_cache, spec)
    got = tri.paged_attention(q, k_cache, v_cache, spec)
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    # one-row tiles (the packed-row graph layout) over the same pages
    rows = AttentionTiles(
        torch.arange(3),
        torch.ones(3, dtype=torch.long),
        torch.tensor([0, 1, 1]),
        torch.tensor([50, 30, 31]),
        table,
        page,
        1,
        splits,
    )
    want_rows = TorchOps.paged_attention(q[:3], k_cache, v_cache, rows)
    torch.testing.assert_close(
        tri.paged_attention(q[:3], k_cache, v_cache, rows), want_rows, rtol=0, atol=atol
    )
    # another launch (the microbench's sweep): 16-key blocks, so each split walks several blocks
    torch.testing.assert_close(
        tri.paged_attention(q[:3], k_cache, v_cache, rows, (16, 2, 2)), want_rows, rtol=0, atol=atol
    )
    if splits > 1:
        # The last split to arrive merged the partials in the same launch and left its counter at zero,
        # so a second call (a graph replay, the next layer) merges again from a clean count.
        from services.common.kernels import triton_ops

        counters = triton_ops._COUNTERS[q.device]
        assert int(counters.abs().sum()) == 0
        got = tri.paged_attention(q[:3], k_cache, v_cache, rows)
        torch.testing.assert_close(got, want_rows, rtol=0, atol=atol)
        assert int(counters.abs().sum()) == 0


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert select_backend(cpu) == select_backend(cpu, "auto") == "torch"  # auto: Triton only on CUDA
    assert select_backend(cpu, "triton") == "triton"  # interpreter present
    with pytest.raises(ValueError, match="torch, triton, auto"):
        select_backend(cpu, "cutlass")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        select_backend(cpu, "triton")


def test_key_splits_rule() -> None:
    """The rule gives the best split measured on the H200 (132 SMs, 8 KV heads) at each bench point."""
    from services.common.kernels import key_splits

    measured_best = {(1, 1024): 16, (4, 1024): 8, (8, 1024): 8, (16, 1024): 4, (32, 1024): 2}
    measured_best |= {(1, 4096): 16, (16, 4096): 4, (32, 4096): 2}
    for (tiles, context), best in measured_best.items():
        assert key_splits(tiles, 8, context, 132) == best, (tiles, context)
    assert key_splits(1, 8, 512, 132) == 8  # 64 keys per split while 64 programs leave SMs idle
    assert key_splits(64, 8, 1024, 132) == 1  # 512 programs fill the GPU already
    assert key_splits(1, 8, 64, 132) == 1  # too short to split
