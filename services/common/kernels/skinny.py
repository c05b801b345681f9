"""The decode step's O projection with its residual add (M ≤ 32 rows) as one skinny Triton GEMM.

Why: at a graphed decode step's few rows the GEMM only streams its weight, and cuBLAS runs the
4096 x 4096 O projection as a split-K GEMM plus a separate reduce kernel, then (``addmm_`` with
beta = 1) adds into the residual stream. :func:`linear_accumulate` computes ``residual + h @ W.T`` in one
launch: on the H200 11.5 / 11.8 µs at 1 / 16 rows against cuBLAS's 13.1 / 13.2 µs, the decode step
4.79 → 4.73 ms at 1 row (``bench.thinker --skinny-o both``).

Layout: each program owns ``BLOCK_N`` output columns of every row and streams its ``[BLOCK_N, K/split]``
weight tile (``tl.dot`` on rows padded to 16, or a broadcast multiply and row sum for tiny M). Shapes with
few column tiles split K; the partial sums go to a workspace and the last split to finish (an arrival
counter, as in ``_paged_attention_kernel``) adds them in split order, adds the residual in fp32 and writes
the output, rounded once — one launch, deterministic, graph-safe. Configs come from
:data:`SKINNY_CONFIGS` (keyed by row bucket, N, K; written from ``python -m bench.thinker.skinny``'s
output) or :func:`default_config`, never from autotuning: a tuning run inside a capture, or beside two
other processes on the GPU, would be unsafe and noisy.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.common.kernels.counters import ArrivalCounters
from services.common.kernels.tuned import read_best, row_bucket

MAX_ROWS = 32  # the kernel's limit; the runner uses it up to ``fused_forward.SKINNY_MAX_ROWS``


class SkinnyConfig(NamedTuple):
    """Launch parameters of one (row bucket, N, K) shape."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool  # tl.dot on rows padded to 16; False: broadcast multiply + sum (M ≤ 4 only)


# (row bucket, N, K) -> config, from ``python -m bench.thinker.skinny --device cuda`` on the GPU host
# (it prints this literal). Row buckets are powers of two; a missing bucket takes the nearest one above
# (else below) for the same (N, K); a missing shape takes ``default_config``.
SKINNY_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    # The O projection (2026-12-04, `--rows 1,16 --shapes o`): 11.5 / 11.8 µs vs cuBLAS 13.1 / 13.2 µs.
    (1, 4096, 4096): SkinnyConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4, dot=True),
    (16, 4096, 4096): SkinnyConfig(block_n=32, block_k=256, split_k=2, num_warps=4, num_stages=3, dot=True),
}


def load_table(path: str | os.PathLike[str]) -> dict[tuple[int, int, int], SkinnyConfig]:
    """The best config of each (row bucket, N, K) in a ``bench.thinker.skinny --json-out`` file.

    For a GPU the built-in table was not measured on: tune once with the microbench, then name its
    output in the thinker's ``kernel_table`` profile key (``--kernel-table``); :func:`use_table` loads it
    and its entries win over the built-in ones. A file that is not such a table raises ValueError.
    """
    table = read_best(path, SkinnyConfig, len(SkinnyConfig._fields))
    for key, cfg in table.items():
        if not isinstance(cfg.dot, bool):  # an fp8 sweep's configs have as many fields, all integers
            raise ValueError(f"skinny table {path}: {key} has config {tuple(cfg)}, not a skinny GEMM's")
    return table


def default_config(m: int, n: int, k: int, sms: int = 132) -> SkinnyConfig:
    """Columns in 64-wide tiles; K split (powers of two, each split ≥ 512 deep) until the programs
    reach twice the SM count, so a 4096-column projection still streams from every SM."""
    block_n = 64
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < 16 and tiles * split < 2 * sms and k // (2 * split) >= 512:
        split *= 2
    return SkinnyConfig(block_n, 128, split, 4, 4, True)


def use_table(path: str | os.PathLike[str]) -> int:
    """Add a microbench table's configs to the lookup (before any graph capture); returns how many."""
    table = load_table(path)
    SKINNY_CONFIGS.update(table)
    return len(table)


def config_for(m: int, n: int, k: int) -> SkinnyConfig:
    """The table's config of the shape (nearest row bucket) or the default."""
    b = row_bucket(m)
    buckets = sorted(bb for bb, nn, kk in SKINNY_CONFIGS if (nn, kk) == (n, k))
    if not buckets:
        return default_config(m, n, k)
    pick = next((bb for bb in buckets if bb >= b), buckets[-1])
    return SKINNY_CONFIGS[(pick, n, k)]


@triton.jit(do_not_specialize=["m"])  # type: ignore[untyped-decorator]  # triton ships no type information
def _skinny_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    a_ptr, w_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, m,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER: tl.constexpr, EVEN: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (column tile, K split) program: ``out[:, tile] = res[:, tile] + a[:, split] @ W[tile, split].T``,
    the last split of a tile to finish adding every split's partial in split order. The residual add is in
    fp32, rounded once, as cuBLAS's beta = 1 does; ``res`` may be ``out`` itself, since each element is
    read and then written by the one program that owns it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
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
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            if IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_off = rows[:, None] * N + cols[None, :]
    out_msk = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        acc += tl.load(res_ptr + out_off, mask=out_msk, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_msk)
    else:
        tl.store(ws_ptr + pid_k * BLOCK_M * N + out_off, acc, mask=out_msk)
        # As in _paged_attention_kernel: every thread's partial is stored before the one release; the
        # last arrival reads the partials through L2 (.cg), then leaves its counter at zero for the next call.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    ws_ptr + s * BLOCK_M * N + out_off, mask=out_msk, other=0.0, cache_modifier=".cg"
                )
            total += tl.load(res_ptr + out_off, mask=out_msk, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_msk)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


_COUNTERS = ArrivalCounters("skinny GEMM counters")  # one per column tile of a split-K launch


def linear_accumulate(
    h: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``residual + h @ weight.T`` for ``h [M ≤ 32, K]``, into ``out`` (a new tensor if None; may be
    ``residual`` itself): the folded decode loop's O projection, ``x.addmm_(o, W.T)`` in one launch with no
    split-K reduce kernel after it. Host metadata only: graph-safe."""
    n, k = weight.shape
    m = h.shape[0]
    if m > MAX_ROWS or not (h.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"skinny GEMM takes ≤ {MAX_ROWS} contiguous rows and a contiguous weight")
    if h.shape[1] != k:
        raise ValueError(f"operand {tuple(h.shape)} does not fit weight {tuple(weight.shape)}")
    if residual.shape != (m, n) or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous [{m}, {n}] tensor")
    if out is None:
        out = torch.empty((m, n), dtype=h.dtype, device=h.device)
    elif out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor")
    cfg = config or config_for(m, n, k)
    rows = row_bucket(m)
    block_m = max(16, rows) if cfg.dot else rows
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)  # no empty split: every one arrives at the counter with real work
    tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, block_m, n), dtype=torch.float32, device=h.device) if split > 1 else out
    cnt = _COUNTERS.get(h.device, tiles) if split > 1 else out
    _skinny_kernel[(tiles, split)](
        h,
        weight,
        residual,
        out,
        ws,
        cnt,
        m,
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        K_PER=k_per,
        EVEN=n % cfg.block_n == 0 and k_per * split == k,
        DOT=cfg.dot,
        IEEE=h.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
