"""Fused decoder-layer kernels, with a pure-torch reference for every one of them.

Shared by the stages that run a Qwen/Llama-style decoder: the thinker's step (its ``fused_forward`` module)
and the talker's fused decode (its ``fused_decode`` module). They live here, not in either stage, so
that each stage stands alone (a stage never imports another) and a kernel change is tested once, here
(``tests/test_common_kernels*.py``).

Why: a decode step of the full-size model spends as long outside its weight matmuls as in them when
every norm, rotary, cache write and attention gather is its own handful of small kernels (see
BENCHMARKS.md, Thinker: the matmul-stack floor). The Triton backend (:mod:`.triton_ops`) does each of those jobs in
one kernel and reads keys/values straight from the paged cache (no gather copy):

* ``rms_norm`` / ``add_rms_norm``: the residual add and the next RMSNorm in one pass;
* ``qk_rope_store``: q/k RMSNorm (optional), rotary, and the K/V write into the paged cache in one pass;
* ``paged_attention``: causal attention of query tiles over their sequence's pages (flash-style online
  softmax, GQA folded into the tile rows, optional split over the keys for short batches, merged by
  the last split to finish in the same launch);
* ``silu_mul``: the SwiGLU gate;
* ``rope_attention``: ``qk_rope_store`` and ``paged_attention`` of a packed-row step's one-row tiles in
  one launch (:mod:`.rope_attention`), the default for graphed steps.

``qk_rope_store`` and ``silu_mul`` can also take ``rms_of=(x, eps)``: they first scale each row by the
inverse RMS of the residual row ``x``. That is the input (post-attention) RMSNorm with its weight folded
into the QKV (gate|up) GEMM's columns (the thinker's ``layer_ops.fold_norm_weights``): the GEMM then
reads the residual itself and no norm kernel runs, because ``W @ (g * x * r) = r * ((W * g) @ x)``.

The torch backend (:class:`TorchOps`) computes the same functions with the operation order of the
transformers modules; it is the CPU/CI path and the reference the Triton path is compared with
(tests run the Triton kernels on CPU through Triton's interpreter, ``bench.cuda_smoke`` on the GPU).

``select_backend`` picks: ``torch`` | ``triton`` | ``auto`` (the deploy profile's ``kernels`` key of the
thinker and the talker, ``--kernels`` of their CLIs; ``auto``: Triton on CUDA when it imports, torch
otherwise). With Triton, packed-row decode steps run the O projection with its residual add as one skinny
Triton GEMM (:mod:`.skinny`, ``skinny_o_enabled``: measured faster than cuBLAS), and rotary + K/V write +
attention as one launch (``rope_attention_enabled``); both are the default with no switch (the
``requested`` arguments exist for the A/B benchmarks in ``bench.thinker``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from services.common.kernels.tiles import AttentionTiles as AttentionTiles  # re-exported for the stages

log = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")


def triton_usable(device: torch.device) -> bool:
    """Triton compiles for CUDA devices; on CPU it runs only through its interpreter (tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """The kernel backend for ``device``: ``requested`` (``torch`` | ``triton`` | ``auto``), else ``auto``."""
    want = (requested or "auto").strip().lower()
    if want not in (*BACKENDS, "auto"):
        raise ValueError(f"kernels must be one of torch, triton, auto (got {want!r})")
    if want == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if want == "triton" and not triton_usable(device):
        raise ValueError(
            f"the triton kernel backend needs triton and a CUDA device (or TRITON_INTERPRET=1), not {device}"
        )
    return want


def norm_fold_enabled(device: torch.device, backend: str, requested: bool | None = None) -> bool:
    """Whether packed-row steps run the folded-norm layer loop (no RMSNorm kernels, residual adds inside
    the O and down GEMMs; see the thinker's ``fused_forward``): only with the Triton backend;
    ``requested`` wins, else on with CUDA and off on CPU (where Triton only runs under its interpreter,
    for tests that ask for it).
    """
    if backend != "triton":
        return False
    return device.type == "cuda" if requested is None else bool(requested)


def rope_attention_enabled(requested: bool | None = None) -> bool:
    """Whether packed-row steps run rotary + K/V write + attention as one launch (``rope_attention``,
    :mod:`.rope_attention`): on unless ``requested`` is False (a benchmark's other arm)."""
    return True if requested is None else bool(requested)


def skinny_o_enabled(requested: bool | None = None) -> bool:
    """Whether the folded decode loop's O projection (with its residual add) is the skinny Triton GEMM
    (``skinny.linear_accumulate``: one launch, no split-K reduce kernel) rather than cuBLAS's ``addmm_``:
    on unless ``requested`` is False. On the H200 it took the decode step from 4.79 to 4.73 ms at 1 row
    and 5.14 to 5.06 ms at 16 (``bench.thinker --skinny-o both``)."""
    return True if requested is None else bool(requested)


def inv_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / RMS`` of each row of ``x`` in fp32, shape ``[..., 1]`` (Qwen3RMSNorm's statistics)."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slots] = rows``, rounded to the cache's dtype (an fp8 KV cache: e4m3, no scale, values
    beyond ±448 saturate). An fp8 cache is written through its bytes: ``index_copy_`` has no float8
    kernel on every device."""
    rows = rows.to(cache.dtype)
    if cache.dtype.itemsize == 1:
        cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows)


def read_cache_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]`` widened to the activations' ``dtype`` (exact from e4m3: every e4m3 value is a
    bf16 value)."""
    if cache.dtype.itemsize == 1:
        return cache.view(torch.uint8)[index].view(cache.dtype).to(dtype)
    return cache[index]


def scale_rows_ref(y: torch.Tensor, rms_of: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """``y`` with each row scaled by the inverse RMS of the same row of ``rms_of[0]`` (rounded to ``y``'s
    dtype once); ``y`` itself when ``rms_of`` is None."""
    if rms_of is None:
        return y
    x, eps = rms_of
    return (y.float() * inv_rms_ref(x, eps)).to(y.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the exact operation order of transformers' Qwen3RMSNorm (fp32 statistics)."""
    dtype = x.dtype
    h = x.float()
    h = h * inv_rms_ref(h, eps)
    return weight * h.to(dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it (rotate_half on the two halves of the head)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    """The fused operations as plain torch (reference semantics; CPU and CI path)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps)

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, rms_norm(x + delta))`` with the sum rounded to the activation dtype first."""
        s = x + delta
        return s, rms_norm_ref(s, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, rms_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        gate, up = scale_rows_ref(gate_up, rms_of).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def qk_rope_store(
        qkv: torch.Tensor,
        qk_norm_weight: torch.Tensor | None,
        eps: float,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        hq: int,
        hkv: int,
        rms_of: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """q/k norms and rotary of packed ``qkv [T, (hq+2hkv)*D]``; K/V go to the cache; returns q.

        ``qk_norm_weight`` None: rotary only (Llama-style backbones without q/k norms, e.g. the talker).
        ``rms_of``: scale the rows first (the folded input norm, see the module doc).
        """
        qkv = scale_rows_ref(qkv, rms_of)
        t = qkv.shape[0]
        d = cos_table.shape[-1]
        qk = qkv[:, : (hq + hkv) * d].reshape(t, hq + hkv, d)
        v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
        cos = cos_table.index_select(0, positions)[:, None, :]
        sin = sin_table.index_select(0, positions)[:, None, :]
        if qk_norm_weight is not None:
            qk = rms_norm_ref(qk, qk_norm_weight, eps)
        qk = rotate_ref(qk, cos, sin)
        write_cache_rows(k_cache, write_slots, qk[:, hq:])
        write_cache_rows(v_cache, write_slots, v)
        return qk[:, :hq]

    @staticmethod
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
    ) -> torch.Tensor:
        """``qk_rope_store`` at the tiles' positions, then ``paged_attention`` (what the Triton kernel of
        :mod:`.rope_attention` does in one launch for one-row tiles)."""
        q = TorchOps.qk_rope_store(
            qkv, qk_norm_weight, eps, cos_table, sin_table, tiles.pos, write_slots, k_cache, v_cache,
            hq, k_cache.shape[1], rms_of,
        )  # fmt: skip
        return TorchOps.paged_attention(q, k_cache, v_cache, tiles)

    @staticmethod
    def paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tiles: AttentionTiles,
    ) -> torch.Tensor:
        """Reference of the Triton kernel: each tile's rows attend causally over their sequence's pages."""
        t, hq, d = q.shape
        hkv = k_cache.shape[1]
        g = hq // hkv
        out = torch.zeros_like(q)
        page = tiles.page_size
        rows, lens, seqs, poss = (x.tolist() for x in (tiles.row, tiles.length, tiles.seq, tiles.pos))
        for row, n, seq, pos in zip(rows, lens, seqs, poss, strict=True):
            if n <= 0:
                continue
            total = pos + n
            j = torch.arange(total, device=q.device)
            slots = tiles.table[seq].index_select(0, j // page) * page + j % page
            k = read_cache_rows(k_cache, slots, q.dtype).transpose(0, 1)  # [Hkv, L, D]
            v = read_cache_rows(v_cache, slots, q.dtype).transpose(0, 1)
            qt = q[row : row + n].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
            allowed = j[None, :] <= (pos + torch.arange(n, device=q.device))[:, None]  # [n, L]
            mask = allowed.repeat(g, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qt[None], k[None], v[None], attn_mask=mask)
            out[row : row + n] = o[0].view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        return out


def key_splits(tiles: int, kv_heads: int, context: int, sms: int) -> int:
    """Key splits per tile (a power of two, at most 16) so that few tiles still spread over the SMs.

    Decode attention is latency-bound (a loop of dependent page, K and V loads per program), so more,
    shorter programs finish sooner until the GPU is full: split while the programs stay within four per
    SM and every split keeps at least 128 keys (two 64-key blocks), or 64 keys while the programs do not
    yet fill the SMs once. The partials are merged by the last split to finish, in the same launch.
    This is the measured best split at every point of ``python -m bench.thinker.attention`` on the
    H200 (batch 1..32, context 1024 and 4096; ``tests/test_thinker_kernels.py`` holds the rule to it).
    """
    s = 1
    while s < 16 and tiles * kv_heads * 2 * s <= 4 * sms:
        keys = context // (2 * s)
        if keys < 64 or (keys < 128 and tiles * kv_heads * 2 * s > sms):
            break
        s *= 2
    return s


def get_ops(backend: str) -> Any:  # TorchOps or TritonOps: the same static methods, no declared protocol
    """The ops object of ``backend`` (the Triton module is imported only when asked for)."""
    if backend == "torch":
        return TorchOps
    if backend == "triton":
        from services.common.kernels.triton_ops import TritonOps

        return TritonOps
    raise ValueError(f"unknown kernel backend {backend!r}")
