"""Triton device functions shared by the fused kernels (:mod:`.triton_ops`, :mod:`.rope_attention`).

Each is inlined into its caller; they exist so that the rotary kernel and the fused rotary + attention
kernel round exactly alike, and the paged-attention kernels share one key loop and one split-K merge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def row_inv_rms(x_ptr, row, eps, HIDDEN: tl.constexpr, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """``1 / RMS`` of row ``row`` of ``x [*, HIDDEN]`` in fp32 (the statistics of a folded RMSNorm; one row
    per program)."""
    acc = tl.zeros([CHUNK], tl.float32)
    for c in tl.static_range(0, HIDDEN, CHUNK):
        cols = c + tl.arange(0, CHUNK)
        v = tl.load(x_ptr + row * HIDDEN + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
        acc += v * v
    return 1.0 / tl.sqrt(tl.sum(acc, axis=0) / HIDDEN + eps)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def norm_rope_tile(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    x, xp, inv_x, w, wp, c, s, eps, lower, SCALED: tl.constexpr, HAS_NORM: tl.constexpr, D: tl.constexpr
):
    """Rotary of a ``[M, D]`` tile of heads (``xp``: the same heads at the rotate-half partner columns).

    First each row is scaled by ``inv_x`` (``SCALED``: the folded input norm), then RMS-normed per head
    with weights ``w``/``wp`` (``HAS_NORM``: Qwen3's q/k norm), then rotated by ``c``/``s`` (fp32);
    ``lower``: the first half of the columns. Rounds to the activation dtype where the torch reference
    does (the scaled row, the normed head before its weight and after, each rotary product).
    """
    if SCALED:
        x = (x.to(tl.float32) * inv_x).to(x.dtype)
        xp = (xp.to(tl.float32) * inv_x).to(xp.dtype)
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
        xn = (w * (xf * inv[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
        xpn = (wp * (xp.to(tl.float32) * inv[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    else:
        xn = x
        xpn = xp
    rot = tl.where(lower, -xpn.to(tl.float32), xpn.to(tl.float32))
    a = (xn.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (rot * s).to(x.dtype).to(tl.float32)
    return (a + b).to(x.dtype)


@triton.jit
def to_cache(x, cache_ptr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """``x`` rounded to the KV cache's element type; an fp8 (e4m3) cache saturates at ±448 first, as
    torch's conversion does, so the Triton and torch paths store the same bytes."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def block_slots(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    table_row_ptr,
    kb,
    limit,
    kvh,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys ``j = kb .. kb + BLOCK_N`` of one sequence's pages: ``j``, ``j < limit`` and each key's row
    offset into a ``[slots, HKV, D]`` cache for KV head ``kvh``."""
    j = kb + tl.arange(0, BLOCK_N)
    ok = j < limit
    page = tl.load(table_row_ptr + j // PAGE, mask=ok, other=0).to(tl.int64)
    return j, ok, ((page * PAGE + j % PAGE) * HKV + kvh) * D


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def load_rows(cache_ptr, kv_off, ok, D: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """The ``[BLOCK_N, D]`` cache rows at ``kv_off`` (0 where not ``ok``), in the cache's dtype."""
    d_idx = tl.arange(0, D)
    return tl.load(cache_ptr + kv_off[:, None] + d_idx[None, :], mask=ok[:, None], other=0.0)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def block_scores(q, k, j, ok, q_pos, m_i, l_i, scale_log2, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """The online-softmax step of one key block ``k [BLOCK_N, D]`` (keys ``j``, those ``ok`` and at most
    each row's ``q_pos`` allowed): returns ``m_new``, the weights ``p`` and ``alpha`` and the new ``l``."""
    # An fp8 cache widens to the query's dtype (exact) before the dot; a no-op for a bf16 one.
    k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    allowed = ok[None, :] & (j[None, :] <= q_pos[:, None])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, p, alpha, l_i * alpha + tl.sum(p, axis=1)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def block_values(acc, p, alpha, v, q, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """``acc`` rescaled by ``alpha`` plus ``p @ v`` of one key block (``v`` widened to ``q``'s dtype)."""
    v = v.to(q.dtype)
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def attend_pages(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    q,
    m_i,
    l_i,
    acc,
    table_row_ptr,
    start,
    end,
    q_pos,
    k_ptr,
    v_ptr,
    kvh,
    scale_log2,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    V_EARLY: tl.constexpr,
):
    """Online-softmax attention of ``q [M, D]`` (rows at positions ``q_pos``) over keys ``[start, end)`` of
    one sequence's pages (``table_row_ptr``: its block-table row); returns the updated ``m, l, acc``.

    ``V_EARLY``: issue a block's V load beside its K load, before the scores (both in flight at once, at
    the cost of the V tile's registers through the softmax); otherwise after them. The same result."""
    for kb in range(start, end, BLOCK_N):
        j, ok, kv_off = block_slots(table_row_ptr, kb, end, kvh, HKV, D, PAGE, BLOCK_N)
        k = load_rows(k_ptr, kv_off, ok, D).to(q.dtype)  # widened as it lands (block_scores: a no-op)
        if V_EARLY:
            v = load_rows(v_ptr, kv_off, ok, D)
        m_new, p, alpha, l_i = block_scores(q, k, j, ok, q_pos, m_i, l_i, scale_log2, IEEE)
        if not V_EARLY:
            v = load_rows(v_ptr, kv_off, ok, D)
        acc = block_values(acc, p, alpha, v, q, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attend_one(q, m_i, l_i, acc, k, v, allowed, scale_log2):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """:func:`attend_pages` for one key held in registers (``k``/``v``: ``[1, D]``, ``allowed``: ``[M]``):
    the score in fp32 from the same products a dot would sum, the weight rounded to ``v``'s dtype."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale_log2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, l_i, acc


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def write_output(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    acc,
    m_i,
    l_i,
    o_ptr,
    po_ptr,
    pm_ptr,
    pl_ptr,
    counter_ptr,
    q_rows,
    head,
    m_valid,
    split,
    n_rows,
    HQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Normalise and store rows ``q_rows`` x heads ``head`` of the output; with split-K, store this split's
    partial and let the last split of the (tile, KV head) to arrive merge all of them (no second launch).

    The barrier orders every thread's partial stores before the one thread's release; the merging side
    loads the partials through L2 (``.cg``), never a stale L1 line, and resets the counter for the next
    call.
    """
    d_idx = tl.arange(0, D)
    q_off = (q_rows * HQ + head) * D
    if SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            o_ptr + q_off[:, None] + d_idx[None, :], out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None]
        )
    else:
        part = (split * n_rows + q_rows) * HQ + head
        tl.store(po_ptr + part[:, None] * D + d_idx[None, :], acc, mask=m_valid[:, None])
        tl.store(pm_ptr + part, m_i, mask=m_valid)
        tl.store(pl_ptr + part, l_i, mask=m_valid)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            m_max = tl.full(m_i.shape, float("-inf"), tl.float32)
            for s_i in tl.static_range(SPLITS):
                ps = (s_i * n_rows + q_rows) * HQ + head
                m_s = tl.load(pm_ptr + ps, mask=m_valid, other=float("-inf"), cache_modifier=".cg")
                m_max = tl.maximum(m_max, m_s)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no row saw a key: weights 0, not NaN
            num = tl.zeros(acc.shape, tl.float32)
            den = tl.zeros(m_i.shape, tl.float32)
            for s_i in tl.static_range(SPLITS):
                ps = (s_i * n_rows + q_rows) * HQ + head
                m_s = tl.load(pm_ptr + ps, mask=m_valid, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(pl_ptr + ps, mask=m_valid, other=0.0, cache_modifier=".cg")
                a_s = tl.load(
                    po_ptr + ps[:, None] * D + d_idx[None, :],
                    mask=m_valid[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_max))
                num += a_s * w[:, None]
                den += l_s * w
            den = tl.where(den == 0.0, 1.0, den)
            tl.store(
                o_ptr + q_off[:, None] + d_idx[None, :],
                (num / den[:, None]).to(o_ptr.dtype.element_ty),
                mask=m_valid[:, None],
            )
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
