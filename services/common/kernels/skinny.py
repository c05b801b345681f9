"""Skinny GEMMs of the decode step (M ≤ 32 rows) in Triton, with the step's norms and SwiGLU as prologues.

Why: a graphed decode step of the full-size thinker runs ~180 small kernels besides its GEMMs, and on an
H200 their launch gaps are most of what separates the step from its matmul-stack floor; cuBLAS itself
reaches only ~3.3 of 4.26 TB/s on these skinny shapes. Here each GEMM reads its activations through a
prologue that does the work of the kernel that used to precede it, so per layer the input RMSNorm (with
the residual add), the post-attention RMSNorm and the SwiGLU are no longer launches of their own:

* ``linear_add_rms_norm(x, delta, w_norm, eps, W)`` → ``(x + delta, rms_norm(x + delta) @ W.T)``;
* ``linear_rms_norm(x, w_norm, eps, W)`` → ``rms_norm(x) @ W.T`` (the first layer: no residual yet);
* ``linear_silu_mul(gate_up, W)`` → ``silu(gate) * up @ W.T``;
* ``linear(h, W)`` → ``h @ W.T`` (the O projection), bias optional everywhere.

The prologues round where :mod:`.triton_ops`' norm and gate kernels round (the residual sum, the
normalised value and its product with the weight, the SiLU and its product with ``up``), so the GEMM's
operand is the old kernel's output up to the fp32 summation order of the row's sum of squares (each
program sums the whole row itself, in ``BLOCK_K`` chunks: the row is a few KiB read from L2, cheaper than
a launch); the residual ``x + delta`` is bit for bit the old one, written by program (0, 0) alone.

Layout: each program owns ``BLOCK_N`` output columns of every row and streams its ``[BLOCK_N, K/split]``
weight tile (``tl.dot`` on rows padded to 16, or a broadcast multiply and row sum for tiny M). Shapes with
few column tiles split K; the partial sums go to a workspace and the last split to finish (an arrival
counter, as in ``_paged_attention_kernel``) adds them in split order and writes the output — one launch,
deterministic, graph-safe. Configs come from :data:`SKINNY_CONFIGS` (keyed by row bucket, N, K; written
from ``python -m bench.thinker.skinny``'s output) or :func:`default_config`, never from autotuning: a
tuning run inside a capture, or beside two other processes on the GPU, would be unsafe and noisy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.common.kernels.counters import ArrivalCounters

PLAIN, RMS_NORM, ADD_RMS_NORM, SILU_MUL = 0, 1, 2, 3
MAX_ROWS = 32  # the kernel's limit; the runner uses it up to ``fused_forward.SKINNY_MAX_ROWS``
STAT_ELEMS = 2048  # elements per chunk of the sum-of-squares pass (rows x columns)


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
    and its entries win over the built-in ones.
    """
    rows = json.loads(Path(path).read_text())
    return {
        (row_bucket(int(r["rows"])), int(r["n"]), int(r["k"])): SkinnyConfig(*r["best"]["config"])
        for r in rows
        if r.get("best")
    }


def row_bucket(m: int) -> int:
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


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


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _inv_rms(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    a_ptr, d_ptr, xo_ptr, m, eps, write_x,
    K: tl.constexpr, ROWS: tl.constexpr, STAT_K: tl.constexpr, HAS_DELTA: tl.constexpr,
):  # fmt: skip
    """1/RMS of each of the ``ROWS`` rows over the full K (the residual sum first, written if asked)."""
    rows = tl.arange(0, ROWS)
    kk = tl.arange(0, STAT_K)
    sq = tl.zeros([ROWS, STAT_K], tl.float32)
    for k0 in range(0, K, STAT_K):
        k = k0 + kk
        msk = (rows[:, None] < m) & (k[None, :] < K)
        off = rows[:, None] * K + k[None, :]
        x = tl.load(a_ptr + off, mask=msk, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + off, mask=msk, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(xo_ptr.dtype.element_ty)
            if write_x:
                tl.store(xo_ptr + off, x, mask=msk)
        h = x.to(tl.float32)
        sq += h * h
    return 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _operand(a_ptr, d_ptr, nw_ptr, rows, row_ok, k, k_ok, inv, K: tl.constexpr, PROLOGUE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """The ``[rows, k]`` tile of the GEMM's left operand, through the prologue (activation dtype)."""
    msk = row_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 3:  # SwiGLU of gate_up [M, 2K]
        off = rows[:, None] * (2 * K) + k[None, :]
        gate = tl.load(a_ptr + off, mask=msk, other=0.0)
        up = tl.load(a_ptr + off + K, mask=msk, other=0.0)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    else:
        off = rows[:, None] * K + k[None, :]
        a = tl.load(a_ptr + off, mask=msk, other=0.0)
        if PROLOGUE == 2:
            d = tl.load(d_ptr + off, mask=msk, other=0.0)
            a = (a.to(tl.float32) + d.to(tl.float32)).to(d.dtype)
        if PROLOGUE != 0:
            hn = (a.to(tl.float32) * inv[:, None]).to(a.dtype)
            w = tl.load(nw_ptr + k, mask=k_ok, other=0.0)
            a = (w.to(tl.float32)[None, :] * hn.to(tl.float32)).to(a.dtype)
    return a


@triton.jit(do_not_specialize=["m"])  # type: ignore[untyped-decorator]  # triton ships no type information
def _skinny_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    a_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, xo_ptr, ws_ptr, cnt_ptr, res_ptr, m, eps,
    N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAT_K: tl.constexpr, SPLIT_K: tl.constexpr, K_PER: tl.constexpr, EVEN: tl.constexpr,
    DOT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (column tile, K split) program: ``out[:, tile] = prologue(a)[:, split] @ W[tile, split].T``,
    the last split of a tile to finish adding every split's partial in split order. ``HAS_RES``: the
    output is ``res + product`` (the residual add in fp32, rounded once, as cuBLAS's beta = 1 does); ``res``
    may be ``out`` itself, since each element is read and then written by the one program that owns it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    inv = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        write_x = (pid_n == 0) & (pid_k == 0)
        inv_r = _inv_rms(a_ptr, d_ptr, xo_ptr, m, eps, write_x, K, ROWS, STAT_K, PROLOGUE == 2)
        if ROWS == BLOCK_M:
            inv = inv_r
        else:  # widen to the operand's padded rows (padded rows are masked to zero anyway)
            same = rows[:, None] == tl.arange(0, ROWS)[None, :]
            inv = tl.sum(tl.where(same, inv_r[None, :], 0.0), axis=1)
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
        a = _operand(a_ptr, d_ptr, nw_ptr, rows, row_ok, k, k_ok, inv, K, PROLOGUE)
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
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
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_RES:
                total += tl.load(res_ptr + out_off, mask=out_msk, other=0.0, cache_modifier=".cg").to(
                    tl.float32
                )
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_msk)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


_COUNTERS = ArrivalCounters("skinny GEMM counters")  # one per column tile of a split-K launch


def _launch(
    prologue: int,
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    x_out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes, config and buffers of one launch (host metadata only: graph-safe)."""
    n, k = weight.shape
    m = a.shape[0]
    if m > MAX_ROWS or not (a.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"skinny GEMM takes ≤ {MAX_ROWS} contiguous rows and a contiguous weight")
    if a.shape[1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"operand {tuple(a.shape)} does not fit weight {tuple(weight.shape)}")
    cfg = config or config_for(m, n, k)
    rows = row_bucket(m)
    block_m = max(16, rows) if cfg.dot else rows
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)  # no empty split: every one arrives at the counter with real work
    tiles = triton.cdiv(n, cfg.block_n)
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous [{m}, {n}] tensor")
    ws = torch.empty((split, block_m, n), dtype=torch.float32, device=a.device) if split > 1 else out
    cnt = _COUNTERS.get(a.device, tiles) if split > 1 else out
    _skinny_kernel[(tiles, split)](
        a,
        a if delta is None else delta,
        a if norm_weight is None else norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        out if x_out is None else x_out,
        ws,
        cnt,
        out if residual is None else residual,
        m,
        eps,
        N=n,
        K=k,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        ROWS=rows,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        STAT_K=min(triton.next_power_of_2(k), max(16, STAT_ELEMS // rows)),
        SPLIT_K=split,
        K_PER=k_per,
        EVEN=n % cfg.block_n == 0 and k_per * split == k,
        DOT=cfg.dot,
        IEEE=a.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def linear(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` for ``h [M ≤ 32, K]``."""
    return _launch(PLAIN, h, weight, bias, config=config)


def linear_accumulate(
    h: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``residual + h @ weight.T`` for ``h [M ≤ 32, K]``, into ``out`` (a new tensor if None; may be
    ``residual`` itself): the folded decode loop's O projection, ``x.addmm_(o, W.T)`` in one launch with no
    split-K reduce kernel after it."""
    return _launch(PLAIN, h, weight, config=config, residual=residual, out=out)


def linear_rms_norm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``rms_norm(x) @ weight.T (+ bias)``, the norm as ``TritonOps.rms_norm`` rounds it."""
    return _launch(RMS_NORM, x, weight, bias, norm_weight=norm_weight, eps=eps, config=config)


def linear_add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) @ weight.T (+ bias))``, as ``TritonOps.add_rms_norm`` rounds."""
    if delta.shape != x.shape or not delta.is_contiguous():
        raise ValueError("delta must be a contiguous tensor of x's shape")
    x_new = torch.empty_like(x)
    y = _launch(ADD_RMS_NORM, x, weight, bias, delta, norm_weight, eps, x_new, config)
    return x_new, y


def linear_silu_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T (+ bias)`` for ``gate_up [M, 2K]``, the gate as ``silu_mul`` rounds."""
    return _launch(SILU_MUL, gate_up, weight, bias, config=config)
