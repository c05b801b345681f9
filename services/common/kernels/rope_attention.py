"""Rotary, the K/V write and paged attention of a packed-row step in one Triton launch.

Why: in a graphed decode step the rotary kernel (``qk_rope_store``) is a launch of its own between the
QKV GEMM and attention in each of the 36 layers; at one row it costs ~2.4 µs of a ~4.8 ms step, mostly
launch and dependency latency, not work. Here each attention program norms and rotates its own query
heads from the QKV GEMM's output and takes the newest keys from there too, so the cache is only written,
never read back, within the step.

The catch is a packed step that holds several consecutive tokens of one sequence (a short prefill chunk
packed as rows): row ``r`` must see the keys of the rows before it, which the programs of those rows
write in this same launch. So every row finds its *fresh* rows (the rows before it in this step with the
same first block and consecutive positions; blocks belong to one sequence, so that is exact), reads only
the keys before them from the cache, and computes the fresh keys itself from the QKV output (one at a
time, dealt round the row's key-split programs). A decode row has no fresh rows but its own token.
A row looks back at most ``LOOKBACK`` rows, so a step may hold at most that many: a caller runs larger
steps as rotary + K/V write, then attention (two launches), where a long chunk costs no serial chain.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.common.kernels.counters import ArrivalCounters, split_scratch
from services.common.kernels.tiles import AttentionTiles
from services.common.kernels.triton_parts import (
    attend_one,
    attend_pages,
    block_scores,
    block_slots,
    block_values,
    load_rows,
    norm_rope_tile,
    row_inv_rms,
    to_cache,
    write_output,
)

LOOKBACK = 32  # how far fresh rows reach: the most rows of a step this kernel may serve


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _fresh_key(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, row, pos, inv_x, eps, kh, vh, d_idx, lower,
    D: tl.constexpr, WIDTH: tl.constexpr, HAS_NORM: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Key head ``kh`` (normed, rotated at ``pos``) and value head ``vh`` of packed row ``row``, as
    ``qk_rope_store`` writes them to the cache: ``[1, D]`` tiles in the cache's dtype (what a later
    step reads back; the caller widens them to attend)."""
    half: tl.constexpr = D // 2
    partner = (d_idx + half) % D
    base = qkv_ptr + row * WIDTH
    x = tl.load(base + kh * D + d_idx)
    xp = tl.load(base + kh * D + partner)
    w = 0.0
    wp = 0.0
    if HAS_NORM:
        w = tl.load(w_ptr + kh * D + d_idx).to(tl.float32)
        wp = tl.load(w_ptr + kh * D + partner).to(tl.float32)
    c = tl.load(cos_ptr + pos * D + d_idx).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + d_idx).to(tl.float32)
    k = norm_rope_tile(x, xp, inv_x, w, wp, c, s, eps, lower, SCALED, HAS_NORM, D)
    v = tl.load(base + vh * D + d_idx)
    if SCALED:
        v = (v.to(tl.float32) * inv_x).to(v.dtype)
    return to_cache(k, k_ptr), to_cache(v, v_ptr)


@triton.jit(  # type: ignore[untyped-decorator]  # triton ships no type information
    do_not_specialize=["table_stride", "n_rows"],
    do_not_specialize_on_alignment=["pos_ptr", "slot_ptr", "table_ptr"],
)
def _rope_attention_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    qkv_ptr, w_ptr, cos_ptr, sin_ptr, x_ptr, pos_ptr, slot_ptr, table_ptr, table_stride,
    k_ptr, v_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, n_rows, eps, x_eps, scale_log2,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, LOOK: tl.constexpr,
    HAS_NORM: tl.constexpr, SCALED: tl.constexpr, HIDDEN: tl.constexpr, CHUNK: tl.constexpr,
    IEEE: tl.constexpr, V_EARLY: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """One (row, KV head, key split) program: the row's query heads of this KV head, normed and rotated;
    cached keys before the row's fresh rows; in the last split also the fresh keys and the K/V write.

    ``PRELOAD``: the split's first key block (page ids, keys, values) is loaded first, before the fresh-row
    search, the row's RMS and the query's rotary, so its memory latency overlaps theirs; the splits are
    then cut from the row's position instead of its cached length (the same cut for a decode row)."""
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    WIDTH: tl.constexpr = (HQ + 2 * HKV) * D
    p = tl.load(pos_ptr + r)
    if PRELOAD:  # keys below p cover every cached key of the row (fresh rows sit just below it)
        per = tl.cdiv(tl.cdiv(p, SPLITS), BLOCK_N) * BLOCK_N
        start = split * per
        lim0 = tl.minimum(p, start + per)
        j0, ok0, off0 = block_slots(table_ptr + r * table_stride, start, lim0, kvh, HKV, D, PAGE, BLOCK_N)
        k0 = load_rows(k_ptr, off0, ok0, D)
        v0 = load_rows(v_ptr, off0, ok0, D)
    back = tl.arange(0, LOOK) + 1
    prev = r - back
    ok = prev >= 0
    first_block = tl.load(table_ptr + r * table_stride)
    prev_block = tl.load(table_ptr + prev * table_stride, mask=ok, other=-1)
    prev_pos = tl.load(pos_ptr + prev, mask=ok, other=-1)
    fresh = tl.sum((ok & (prev_block == first_block) & (prev_pos == p - back)).to(tl.int32), axis=0)
    inv_x = 1.0
    if SCALED:  # the input norm folded into the QKV GEMM: the row's 1/RMS
        inv_x = row_inv_rms(x_ptr, r, x_eps, HIDDEN, CHUNK)
    half: tl.constexpr = D // 2
    d_idx = tl.arange(0, D)[None, :]
    lower = d_idx < half
    m_idx = tl.arange(0, BLOCK_M)
    m_valid = m_idx < G
    head = kvh * G + m_idx
    q_at = qkv_ptr + r * WIDTH + head[:, None] * D
    qx = tl.load(q_at + d_idx, mask=m_valid[:, None], other=0.0)
    qxp = tl.load(q_at + (d_idx + half) % D, mask=m_valid[:, None], other=0.0)
    wq = 0.0
    wqp = 0.0
    if HAS_NORM:
        w_at = w_ptr + head[:, None] * D
        wq = tl.load(w_at + d_idx, mask=m_valid[:, None], other=0.0).to(tl.float32)
        wqp = tl.load(w_at + (d_idx + half) % D, mask=m_valid[:, None], other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + p * D + d_idx).to(tl.float32)
    s = tl.load(sin_ptr + p * D + d_idx).to(tl.float32)
    q = norm_rope_tile(qx, qxp, inv_x, wq, wqp, c, s, eps, lower, SCALED, HAS_NORM, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kh = HQ + kvh
    vh = HQ + HKV + kvh
    if split == SPLITS - 1:
        # The row's own key and value first (their loads overlap the query's): into the cache for the
        # steps after this one, and into this row's attention from registers.
        k, v = _fresh_key(
            qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, r, p, inv_x, eps, kh, vh, d_idx, lower, D, WIDTH,
            HAS_NORM, SCALED,
        )  # fmt: skip
        slot = tl.load(slot_ptr + r).to(tl.int64)
        tl.store(k_ptr + (slot * HKV + kvh) * D + d_idx, k)
        tl.store(v_ptr + (slot * HKV + kvh) * D + d_idx, v)
        m_i, l_i, acc = attend_one(q, m_i, l_i, acc, k.to(q.dtype), v.to(q.dtype), m_valid, scale_log2)
    # Earlier rows of this sequence in this step: their keys from qkv, one at a time (a serial chain of
    # loads), dealt round the key splits so that no program computes more than ceil(fresh / SPLITS).
    for i in range(split, fresh, SPLITS):
        row = r - fresh + i
        inv_i = 1.0
        if SCALED:
            inv_i = row_inv_rms(x_ptr, row, x_eps, HIDDEN, CHUNK)
        k, v = _fresh_key(
            qkv_ptr, w_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, row, p - fresh + i, inv_i, eps, kh, vh, d_idx,
            lower, D, WIDTH, HAS_NORM, SCALED,
        )  # fmt: skip
        m_i, l_i, acc = attend_one(q, m_i, l_i, acc, k.to(q.dtype), v.to(q.dtype), m_valid, scale_log2)
    total = p - fresh  # keys written by earlier steps
    q_pos = p + tl.zeros([BLOCK_M], tl.int64)
    if PRELOAD:
        end = tl.minimum(total, start + per)
        # The preloaded block's keys at or past `end` are fresh rows' slots (not yet written, or stale):
        # masked out of the scores, and their values zeroed so that no stale NaN reaches p @ v.
        ok0 = j0 < end
        v0 = tl.where(ok0[:, None], v0.to(q.dtype), 0.0)
        m_new, pw, alpha, l_i = block_scores(q, k0, j0, ok0, q_pos, m_i, l_i, scale_log2, IEEE)
        acc = block_values(acc, pw, alpha, v0, q, IEEE)
        m_i = m_new
        start = start + BLOCK_N
    else:
        per = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
        start = split * per
        end = tl.minimum(total, start + per)
    m_i, l_i, acc = attend_pages(
        q, m_i, l_i, acc, table_ptr + r * table_stride, start, end, q_pos, k_ptr, v_ptr, kvh, scale_log2, HKV,
        D, PAGE, BLOCK_N, IEEE, V_EARLY,
    )  # fmt: skip
    write_output(
        acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr + r * HKV + kvh, r + tl.zeros([BLOCK_M], tl.int64),
        head, m_valid, split, n_rows, HQ, D, SPLITS,
    )  # fmt: skip


_COUNTERS = ArrivalCounters("rope-attention split counters")


def default_launch(rows: int, one_byte_cache: bool = False) -> tuple[int, ...]:
    """``(BLOCK_N, num_warps, num_stages[, v_early[, preload]])`` for a step of ``rows`` rows: the best of
    ``bench.thinker.attention --rope`` at context 576 (µs per layer, one launch vs the two kernels). On
    the H200 with the bf16 cache: 1 row (64, 8, 2) 7.6 vs 8.7; 4 rows (128, 4, 2) 10.0 vs 11.7; 16 rows
    (64, 2, 2) 16.7 vs 19.4 (the default (64, 4, 2) there: 19.4, no gain). Fewer warps at 16 rows: more
    programs resident per SM, so more key loads in flight. With an fp8 (e4m3) cache at 16 rows on the
    H100 (``--kv-cache fp8``): (64, 2, 2) with each block's values loaded beside its keys, 18.4 against
    19.4 µs; wider blocks, fewer or more key splits and deeper pipelines were no faster (BENCHMARKS.md,
    "Latest measurements on the H100", the fp8 gap at batch 16). With the bf16 cache the early values
    measured no gain (20.5 either way)."""
    if rows <= 2:
        return 64, 8, 2
    if rows <= 8:
        return 128, 4, 2
    return (64, 2, 2, 1) if one_byte_cache else (64, 2, 2)


def rope_attention(
    qkv: torch.Tensor,
    qk_norm_weight: torch.Tensor | None,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: AttentionTiles,
    hq: int,
    rms_of: tuple[torch.Tensor, float] | None = None,
    launch: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``qk_rope_store`` then ``paged_attention`` over one-row tiles (a packed-row step), one launch.

    ``tiles`` must be the thinker's ``FusedForward.row_tiles`` (row ``i`` is tile
    ``i`` over block-table row ``i``); returns the attention output ``[T, hq, D]``. ``launch``:
    ``(BLOCK_N, num_warps, num_stages[, v_early[, preload]])`` instead of the default
    (``bench.thinker.attention --rope``; ``preload``: the kernel's ``PRELOAD``, off unless named).
    """
    if tiles.block_t != 1:
        raise ValueError("rope_attention takes the one-row tiles of a packed-row step")
    t = qkv.shape[0]
    hkv = k_cache.shape[1]
    d = cos_table.shape[-1]
    g = hq // hkv
    out = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    splits = tiles.splits
    po, pm, pl, counters = split_scratch(_COUNTERS, out, splits, t * hkv)
    x, x_eps = rms_of if rms_of is not None else (qkv, 0.0)
    hidden = x.shape[-1] if rms_of is not None else 1
    block_n, warps, stages, *rest = launch or default_launch(t, k_cache.element_size() == 1)
    v_early = bool(rest[0]) if rest else False
    preload = bool(rest[1]) if len(rest) > 1 else False
    _rope_attention_kernel[(t, hkv, splits)](
        qkv, qkv if qk_norm_weight is None else qk_norm_weight, cos_table, sin_table, x, tiles.pos,
        write_slots, tiles.table, tiles.table.stride(0), k_cache, v_cache, out, po, pm, pl, counters, t,
        eps, x_eps, (1.0 / math.sqrt(d)) * 1.4426950408889634,
        HQ=hq, HKV=hkv, G=g, D=d, PAGE=tiles.page_size, BLOCK_M=max(16, triton.next_power_of_2(g)),
        BLOCK_N=block_n, SPLITS=splits, LOOK=LOOKBACK, HAS_NORM=qk_norm_weight is not None,
        SCALED=rms_of is not None, HIDDEN=hidden, CHUNK=min(1024, triton.next_power_of_2(hidden)),
        IEEE=qkv.dtype == torch.float32, V_EARLY=v_early, PRELOAD=preload, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
