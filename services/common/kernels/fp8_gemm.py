"""fp8 weight-only GEMMs: e4m3 weights with one fp32 scale per output channel, bf16 activations.

Why: a decode step of the full-size thinker streams every weight byte once (15.1 GB in bf16), so the
step is memory-bound and its floor is those bytes over HBM bandwidth. Storing the projection weights as
``torch.float8_e4m3fn`` halves them; the activations stay in the model's dtype, so nothing about the
step's arithmetic changes except the weights' rounding.

* :func:`~.fp8_quant.quantize_fp8`: ``W ≈ q * s[:, None]`` with ``s = max|W[n, :]| / 448`` per output row (channel),
  ``q = round_to_e4m3(W / s)``; done once at load from the bf16 checkpoint. A row's relative rounding
  error is at most 2^-4 of its largest element (e4m3 has 3 mantissa bits), and the row keeps its own
  range, so one outlier row costs no other row precision.
* :func:`fp8_linear`: ``[residual +] (a @ q.T) * s (+ bias)`` in one Triton launch for any row count.
  Each program loads its ``[BLOCK_N, BLOCK_K]`` fp8 weight tile, widens it to the activation dtype in
  registers (exact: every e4m3 value is a bf16 value), and accumulates ``tl.dot`` in fp32; the scale, the
  bias and the residual are applied once on the fp32 sum, then rounded once — so an O or down projection
  adds into the residual stream in place, as the bf16 path's ``addmm_`` (beta = 1) does.
  Decode steps (≤ 32 rows) pad the rows to a 16- or 32-row tile and split K over several programs when
  the column tiles alone would leave SMs idle; the last split of a tile to finish merges the partials in
  split order (an arrival counter, as in :mod:`.skinny`): one launch, deterministic, graph-safe. Prefill
  (many rows) uses 128×128 tiles with no split: dequantizing tiles in registers reads each weight byte
  once per row tile, where materialising a bf16 copy of the matrix per GEMM would read and write three
  times its fp8 bytes (most of a short prompt's step).
* :func:`~.fp8_quant.fp8_linear_ref`: the same function in torch (fp32 arithmetic), the CPU reference of tests.

Weight-only rather than ``torch._scaled_mm`` with per-token fp8 activations: decode is bandwidth-bound,
where fp8 tensor-core math buys nothing, and quantizing activations would add a second error source (the
residual stream of Qwen3 has large outlier channels) for a prefill-only gain. Configs come from
:data:`FP8_CONFIGS` (``python -m bench.thinker.fp8`` prints entries for it; a sweep's ``--json-out``
loads at start through the thinker's ``fp8_table`` key) or :func:`default_config`, never from
autotuning in the serving process (a tuning run inside a capture, or beside other stages on the GPU,
would be unsafe and noisy).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.common.kernels.counters import ArrivalCounters
from services.common.kernels.fp8_quant import Fp8Weight, fp8_linear_ref, quantize_fp8
from services.common.kernels.tuned import read_best, row_bucket

__all__ = [
    "Fp8Config",
    "Fp8Weight",
    "fp8_linear",
    "fp8_linear_ref",
    "quantize_fp8",
    "row_bucket",
    "use_table",
]

SKINNY_ROWS = 32  # at most this many rows: the decode layout (padded row tile, split K)


class Fp8Config(NamedTuple):
    """Launch parameters of one (row bucket, N, K) shape."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# (row bucket, N, K) -> config, from ``python -m bench.thinker.fp8`` on the GPU host (it prints
# the entries); a missing shape takes ``default_config``. These are the thinker's decode GEMMs (QKV, O,
# gate|up, down, lm_head) at 1 and 16 rows, swept by ``bash bench/gpu/fp8.sh`` on an H100 80GB HBM3, and
# at 64 and 128 rows, the packed steps' graph buckets (decode rows with prefill chunks), swept by
# ``python -m bench.thinker.fp8 --rows 64,128`` on an H100 80GB HBM3: there the default is the prefill
# layout (no K split), 1.15-3.8x slower. The comment is the tuned time and the default config's in the same
# sweep; a shape whose best was the default has no entry.
FP8_CONFIGS: dict[tuple[int, int, int], Fp8Config] = {
    (1, 4096, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4
    ),  # 9.2 us (default 10.3)
    (16, 4096, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4
    ),  # 9.5 us (default 11.0)
    (1, 4096, 12288): Fp8Config(
        block_m=16, block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=4
    ),  # 23.1 us (default 27.1)
    (16, 4096, 12288): Fp8Config(
        block_m=16, block_n=32, block_k=256, split_k=2, num_warps=4, num_stages=4
    ),  # 23.7 us (default 28.1)
    (1, 6144, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4
    ),  # 12.0 us (default 12.4)
    (16, 6144, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4
    ),  # 12.3 us (default 12.8)
    (1, 24576, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4
    ),  # 40.1 us (default 41.2)
    (16, 24576, 4096): Fp8Config(
        block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4
    ),  # 42.0 us (default 43.1)
    (1, 151748, 4096): Fp8Config(
        block_m=16, block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=4
    ),  # 217.5 us (default 222.9)
    (16, 151748, 4096): Fp8Config(
        block_m=16, block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=4
    ),  # 220.6 us (default 225.8)
    (64, 6144, 4096): Fp8Config(
        block_m=64, block_n=64, block_k=64, split_k=4, num_warps=4, num_stages=3
    ),  # 21.3 us (default 29.8)
    (64, 4096, 4096): Fp8Config(
        block_m=64, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3
    ),  # 16.1 us (default 32.4)
    (64, 24576, 4096): Fp8Config(
        block_m=64, block_n=64, block_k=64, split_k=1, num_warps=4, num_stages=3
    ),  # 63.0 us (default 76.6)
    (64, 4096, 12288): Fp8Config(
        block_m=64, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3
    ),  # 35.8 us (default 89.2)
    (64, 151748, 4096): Fp8Config(
        block_m=64, block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3
    ),  # 308.2 us (default 355.8)
    (128, 6144, 4096): Fp8Config(
        block_m=128, block_n=64, block_k=64, split_k=2, num_warps=8, num_stages=3
    ),  # 32.3 us (default 62.5)
    (128, 4096, 4096): Fp8Config(
        block_m=128, block_n=64, block_k=64, split_k=4, num_warps=8, num_stages=3
    ),  # 21.1 us (default 62.6)
    (128, 24576, 4096): Fp8Config(
        block_m=128, block_n=64, block_k=64, split_k=1, num_warps=8, num_stages=3
    ),  # 76.0 us (default 87.1)
    (128, 4096, 12288): Fp8Config(
        block_m=128, block_n=64, block_k=64, split_k=4, num_warps=8, num_stages=3
    ),  # 50.7 us (default 191.3)
}


def _checked(path: str | os.PathLike[str], key: tuple[int, int, int], cfg: Fp8Config) -> Fp8Config:
    """``cfg`` if the kernel can launch it for ``key``'s rows, else ValueError naming the table entry."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    ok = (
        all(isinstance(v, int) and not isinstance(v, bool) for v in cfg)
        and all(t >= 16 and t & (t - 1) == 0 for t in tiles)
        and cfg.split_k in (1, 2, 4, 8, 16)
        and cfg.num_warps in (1, 2, 4, 8, 16)
        and 1 <= cfg.num_stages <= 8
    )
    if not ok:
        raise ValueError(f"fp8 table {path}: {key} has config {tuple(cfg)}, which the fp8 GEMM cannot launch")
    return cfg


def load_table(path: str | os.PathLike[str]) -> dict[tuple[int, int, int], Fp8Config]:
    """The best config of each (row bucket, N, K) in a ``bench.thinker.fp8 --json-out`` file.

    For a GPU the built-in table was not measured on, or for row buckets it leaves to
    :func:`default_config` (the 64- and 128-row packed steps: ``--rows 64,128``): tune once, then name
    the file in the thinker's ``fp8_table`` profile key (``--fp8-table``); :func:`use_table` loads it and
    its entries win over the built-in ones. A file that is not such a table raises ValueError.
    """
    table = read_best(path, Fp8Config, len(Fp8Config._fields))
    return {key: _checked(path, key, cfg) for key, cfg in table.items()}


def use_table(path: str | os.PathLike[str]) -> int:
    """Add a sweep's configs to :data:`FP8_CONFIGS` (before any graph capture); returns how many."""
    table = load_table(path)
    FP8_CONFIGS.update(table)
    return len(table)


def default_config(m: int, n: int, k: int, sms: int = 132) -> Fp8Config:
    """Decode (≤ 32 rows): 64-column tiles 256 deep, K split in powers of two (each split ≥ 512 deep)
    until the programs reach twice the SM count, so a 4096-column projection still streams from every
    SM. More rows: square tiles, no split (compute-bound)."""
    if m <= SKINNY_ROWS:
        block_m = 16 if m <= 16 else 32
        block_n, block_k = 64, 256
        tiles = triton.cdiv(n, block_n)
        split = 1
        while split < 16 and tiles * split < 2 * sms and k // (2 * split) >= 512:
            split *= 2
        return Fp8Config(block_m, block_n, block_k, split, 4, 4)
    if m <= 64:
        return Fp8Config(64, 64, 128, 1, 4, 4)
    return Fp8Config(128, 128, 64, 1, 8, 3)


# Triton's interpreter (CPU tests) runs each program in Python: few, large programs, no split.
INTERPRETER_CONFIG = Fp8Config(16, 512, 128, 1, 4, 1)


def config_for(m: int, n: int, k: int, device: torch.device | None = None) -> Fp8Config:
    """The table's config of the shape (the nearest row bucket above, else below, among the decode
    buckets ≤ 32 rows), else :func:`default_config`."""
    if device is not None and device.type == "cpu":
        return INTERPRETER_CONFIG._replace(block_m=min(64, max(16, triton.next_power_of_2(m))))
    if m <= SKINNY_ROWS:
        b = row_bucket(m)
        buckets = sorted(bb for bb, nn, kk in FP8_CONFIGS if (nn, kk) == (n, k) and bb <= SKINNY_ROWS)
        if buckets:
            pick = next((bb for bb in buckets if bb >= b), buckets[-1])
            cfg = FP8_CONFIGS[(pick, n, k)]
            # a config tuned for 16 rows serves up to 16 (the row tile holds them); 17..32 need 32
            return cfg._replace(block_m=max(cfg.block_m, 16 if m <= 16 else 32))
    return FP8_CONFIGS.get((row_bucket(m), n, k)) or default_config(m, n, k, _sm_count(device))


@triton.jit(do_not_specialize=["m"])  # type: ignore[untyped-decorator]  # triton ships no type information
def _fp8_gemm_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    a_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_ptr, ws_ptr, cnt_ptr, m,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile, K split) program of ``out = [res +] (a @ q.T) * s (+ b)``.

    Row tiles are the fastest grid axis, so the programs in flight share weight tiles through L2 when a
    prefill has several row tiles. With ``SPLIT_K > 1`` (one row tile only) the partials go to ``ws`` and
    the last split to arrive merges them in split order. ``res`` may be ``out`` itself: each element is
    read and then written by the one program that owns it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wa = w.to(a.dtype)  # e4m3 -> activation dtype: exact
        if IEEE:
            acc += tl.dot(a, tl.trans(wa), input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(wa), acc)
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    out_msk = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        ws_off = rows[:, None] * N + cols[None, :]
        tl.store(ws_ptr + pid_k * BLOCK_M * N + ws_off, acc, mask=out_msk)
        # Every thread's partial is stored before the one release; the last arrival reads the partials
        # through L2 (.cg), then leaves its counter at zero for the next launch.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(
                    ws_ptr + s * BLOCK_M * N + ws_off, mask=out_msk, other=0.0, cache_modifier=".cg"
                )
            _fp8_epilogue(
                acc, s_ptr, b_ptr, out_ptr, res_ptr, cols, col_ok, out_off, out_msk, HAS_BIAS, HAS_RES
            )
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _fp8_epilogue(acc, s_ptr, b_ptr, out_ptr, res_ptr, cols, col_ok, out_off, out_msk, HAS_BIAS, HAS_RES)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _fp8_epilogue(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    acc, s_ptr, b_ptr, out_ptr, res_ptr, cols, col_ok, out_off, out_msk,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Scale, bias and residual on the fp32 sum, one rounding to the output dtype."""
    acc = acc * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + out_off, mask=out_msk, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_msk)


_COUNTERS = ArrivalCounters("fp8 GEMM counters")  # one per column tile of a split-K launch
_SMS: dict[torch.device, int] = {}


def _sm_count(device: torch.device | None) -> int:
    if device is None or device.type != "cuda":
        return 8
    sms = _SMS.get(device)
    if sms is None:
        sms = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def fp8_linear(
    a: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """``[residual +] (a @ q.T) * scale (+ bias)`` for ``a [M, K]`` in one Triton launch (host metadata
    only: graph-safe). ``out`` (a new tensor if None) may be ``residual`` itself."""
    q, scale = weight
    n, k = q.shape
    m = a.shape[0]
    if a.dim() != 2 or a.shape[1] != k:
        raise ValueError(f"operand {tuple(a.shape)} does not fit weight {tuple(q.shape)}")
    if not (a.is_contiguous() and q.is_contiguous()):
        raise ValueError("fp8 GEMM takes a contiguous operand and weight")
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous [{m}, {n}] tensor")
    if m == 0:
        return out
    cfg = config or config_for(m, n, k, a.device)
    row_tiles = triton.cdiv(m, cfg.block_m)
    split = cfg.split_k if row_tiles == 1 else 1
    k_per = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)  # no empty split: every one arrives at the counter with real work
    tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, cfg.block_m, n), dtype=torch.float32, device=a.device) if split > 1 else out
    cnt = _COUNTERS.get(a.device, tiles) if split > 1 else out
    _fp8_gemm_kernel[(row_tiles, tiles, split)](
        a,
        q,
        scale,
        scale if bias is None else bias,
        out,
        out if residual is None else residual,
        ws,
        cnt,
        m,
        N=n,
        K=k,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        K_PER=k_per,
        EVEN=n % cfg.block_n == 0 and k_per * split == k,
        IEEE=a.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
