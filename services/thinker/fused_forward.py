"""The thinker's decoder layers through the fused kernels (:mod:`services.common.kernels`).

:class:`FusedForward` is what :class:`~services.thinker.runner.ModelRunner` runs instead of its
pure-torch layer loop when the kernel backend is not ``torch``: per layer add+RMSNorm, the QKV GEMM,
q/k norm + rotary + the K/V write into the paged cache, paged attention straight from the pages (no
gather), the O GEMM, add+RMSNorm, the gate|up GEMM, SwiGLU and the down GEMM, whose residual add is
fused into the next layer's input norm (the last one into the final norm). It also builds the attention
tiles of a step: one-row tiles for a packed-row (graph) step, derived on the device from the graph's
inputs; 16-row tiles of each prefill chunk for an eager step, built on the host.

A packed-row step with the runner's ``norm_fold`` on (the default on CUDA) runs no RMSNorm
kernel at all: the norm weights live in the QKV and gate|up weights
(:func:`~services.thinker.layer_ops.fold_norm_weights`), so those GEMMs read the residual stream itself
and the next kernel (q/k norm + rotary, SwiGLU) scales each row by its ``1/RMS``; the O and down GEMMs add
into the residual in place (cuBLAS with beta = 1). Per layer that is seven launches with cuBLAS's own
GEMMs, not nine: the 72 norm launches of a step and their gaps were what the replay spent beyond the
matmuls and attention. At most :data:`SKINNY_MAX_ROWS` rows the O GEMM with its residual add is one
skinny Triton launch (:func:`services.common.kernels.skinny.linear_accumulate`), faster there than cuBLAS's
``addmm_``. Eager steps keep the norm kernels (with ones as weights once folded).

In a packed-row step of at most :data:`ROPE_ATTENTION_MAX_ROWS` rows (with
:attr:`FusedForward.rope_attention`, on unless a benchmark arm turns it off) the q/k norm + rotary + K/V
write and the paged attention are one launch (:mod:`services.common.kernels.rope_attention`): six
launches per layer on the folded path. Larger packed steps (64- and 128-row buckets: many sessions' decode
rows with the units that arrived together, or a long prefill chunk) write every row's key and value first
and attend in a second launch, so a chunk of any length sees its own keys from the cache: the one-launch
kernel recomputes a row's fresh keys, the rows before it in its chunk, one at a time, which is cheap only
for short chunks.

With fp8 weights (``weights: fp8``) every step's layer loop is :func:`services.thinker.fp8_weights.fp8_layers`
instead: the same loops with the fp8 GEMMs of :mod:`services.common.kernels.fp8_gemm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from services.common.kernels import AttentionTiles, key_splits, rope_attention_enabled, skinny_o_enabled
from services.thinker.kv_cache import BlockPool, PagedKVCache
from services.thinker.layer_ops import FusedLayer

if TYPE_CHECKING:
    from services.thinker.step_types import StepInput


class LayerHost(Protocol):
    """What the fused layer loop uses of its model runner (``ModelRunner``): a protocol, so this module,
    which the runner imports, need not import the runner back."""

    device: torch.device
    cache: PagedKVCache
    model: Any  # the Qwen3 decoder (its embedding and final norm)
    layers: list[FusedLayer]
    ops: Any  # the kernel backend's ops (``kernels.get_ops``)
    norm_fold: bool  # packed-row steps run the folded-norm loop (norm weights inside the GEMMs)
    head_fp8: Any  # the lm_head in fp8 (a kernels.fp8_gemm.Fp8Weight) when the GEMMs run in fp8, else None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor


EAGER_TILE_ROWS = 16  # rows of one sequence per attention tile in eager steps (prefill chunks)
# Packed-row steps of at most this many rows (row buckets 1..32) take the one-launch rope-attention
# kernel; it must not exceed the kernel's look-back (services.common.kernels.rope_attention.LOOKBACK),
# which a test checks: a row's fresh rows (the rows before it in its chunk) are all within that reach.
ROPE_ATTENTION_MAX_ROWS = 32
SKINNY_MAX_ROWS = (
    16  # folded packed-row steps of at most this many rows run the skinny O GEMM (row buckets 1..16)
)


class FusedForward:
    """The fused layer loop and tile builders of one runner (its weights, cache and kernel ops)."""

    def __init__(self, runner: LayerHost) -> None:
        self.runner = runner
        self._row_consts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.folded_passes = 0  # layer loops run with the folded norms (host count: captures, tests)
        # Packed-row steps: rotary + K/V write + attention in one launch (kernels.rope_attention).
        self.rope_attention = rope_attention_enabled()
        # Folded packed-row steps of few rows: the O projection + residual add as one skinny launch.
        self.skinny_o = skinny_o_enabled()
        dev = runner.device
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8

    def layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        tiles: AttentionTiles,
        *,
        packed: bool = False,
    ) -> torch.Tensor:
        """Every decoder layer over packed rows ``x [T, hidden]``; returns the final-norm hidden.

        ``packed``: a packed-row step (the graph body), which may take the folded-norm loop.
        """
        if self.runner.head_fp8 is not None:  # weights: fp8 (services.thinker.fp8_weights)
            from services.thinker.fp8_weights import fp8_layers

            return fp8_layers(self, x, positions, write_slots, tiles, packed)
        if packed and self.runner.norm_fold:
            self.folded_passes += 1
            return self._folded_layers(x, positions, write_slots, tiles)
        r = self.runner
        ops = r.ops
        delta: torch.Tensor | None = None
        for idx, lay in enumerate(r.layers):
            if delta is None:
                h = ops.rms_norm(x, lay.input_norm_weight, lay.input_eps)
            else:
                x, h = ops.add_rms_norm(x, delta, lay.input_norm_weight, lay.input_eps)
            qkv = F.linear(h, lay.qkv_weight, lay.qkv_bias)
            o = self._attention(idx, qkv, positions, write_slots, tiles, one_launch=packed)
            attn_out = F.linear(o, lay.o_weight, lay.o_bias)
            x, h = ops.add_rms_norm(x, attn_out, lay.post_norm_weight, lay.post_eps)
            delta = F.linear(ops.silu_mul(F.linear(h, lay.gate_up_weight)), lay.down_weight)
        return self._final_norm(x, delta)

    def _folded_layers(
        self, x: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, tiles: AttentionTiles
    ) -> torch.Tensor:
        """The layer loop of :meth:`layers` on folded norm weights: no norm kernel before the final one.

        ``x`` is the residual stream throughout: the QKV and gate|up GEMMs read it as it is, the kernel
        after each scales by the row's ``1/RMS`` (``rms_of``), and the O and down GEMMs accumulate into it
        (the first O GEMM writes a new tensor, so the caller's embeddings are never overwritten). With
        :attr:`skinny_o` the O GEMM and its residual add are ``skinny.linear_accumulate`` at ≤ 16 rows.
        """
        r = self.runner
        ops = r.ops
        skinny_o = self.skinny_o and x.shape[0] <= SKINNY_MAX_ROWS
        if skinny_o:
            from services.common.kernels import skinny
        for idx, lay in enumerate(r.layers):
            qkv = F.linear(x, lay.qkv_weight)
            o = self._attention(
                idx, qkv, positions, write_slots, tiles, rms_of=(x, lay.input_eps), one_launch=True
            )
            if skinny_o:  # idx 0 writes a new tensor, so the caller's embeddings are never overwritten
                x = skinny.linear_accumulate(o, lay.o_weight, x, out=None if idx == 0 else x)
            else:
                x = torch.addmm(x, o, lay.o_weight.t()) if idx == 0 else x.addmm_(o, lay.o_weight.t())
            act = ops.silu_mul(F.linear(x, lay.gate_up_weight), rms_of=(x, lay.post_eps))
            x.addmm_(act, lay.down_weight.t())
        return self._final_norm(x, None)

    def _attention(
        self,
        idx: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        tiles: AttentionTiles,
        rms_of: tuple[torch.Tensor, float] | None = None,
        one_launch: bool = False,
    ) -> torch.Tensor:
        """Layer ``idx``'s q/k norm + rotary + K/V write, then paged attention: ``[T, heads * head_dim]``.

        ``rms_of``: the folded input norm's residual row and epsilon (see :meth:`_folded_layers`).
        ``one_launch``: a packed-row step's one-row tiles, run as one ``rope_attention`` launch when
        :attr:`rope_attention` is on and the step has at most :data:`ROPE_ATTENTION_MAX_ROWS` rows."""
        r = self.runner
        lay = r.layers[idx]
        hq, hkv, d = r.num_heads, r.num_kv_heads, r.head_dim
        k_cache, v_cache = r.cache.k[idx], r.cache.v[idx]
        if one_launch and self.rope_attention and qkv.shape[0] <= ROPE_ATTENTION_MAX_ROWS:
            o = r.ops.rope_attention(
                qkv, lay.qk_norm_weight, lay.qk_eps, r.cos, r.sin, write_slots, k_cache, v_cache, tiles,
                hq, rms_of,
            )  # fmt: skip
            return o.view(qkv.shape[0], hq * d)
        q = r.ops.qk_rope_store(
            qkv, lay.qk_norm_weight, lay.qk_eps, r.cos, r.sin, positions, write_slots,
            k_cache, v_cache, hq, hkv, rms_of,
        )  # fmt: skip
        return r.ops.paged_attention(q, k_cache, v_cache, tiles).view(qkv.shape[0], hq * d)

    @staticmethod
    def head_logits(hidden: torch.Tensor, lm_head: torch.nn.Linear) -> torch.Tensor:
        """The lm_head of a packed-row step as ``W @ hiddenᵀ`` (a ``[rows, vocab]`` transposed view).

        Why: for few rows cuBLAS's heuristics pick a much faster kernel with the operands this way round
        (m = vocabulary, n = rows): on the H200 at 16 rows 302 µs against 437 µs for ``hidden @ Wᵀ``, the
        same at 1 row (``bench.thinker.gemm``). The product is the same; only the output's layout differs.
        """
        if lm_head.bias is not None:
            return lm_head(hidden)
        return torch.mm(lm_head.weight, hidden.t()).t()

    def _final_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The model's final RMSNorm (after the last layer's residual add, when there was a layer)."""
        r = self.runner
        norm = r.model.norm
        if delta is None:
            return r.ops.rms_norm(x, norm.weight, float(norm.variance_epsilon))
        return r.ops.add_rms_norm(x, delta, norm.weight, float(norm.variance_epsilon))[1]

    def splits(self, tiles: int, context: int) -> int:
        return key_splits(tiles, self.runner.num_kv_heads, context, self.sms)

    def row_tiles(self, positions: torch.Tensor, table: torch.Tensor) -> AttentionTiles:
        """Tiles of a packed-row step: every row its own one-row tile over its own block-table row.

        Graph-safe: the row/length tensors are cached per row count (created during the warm-up passes
        that precede a capture), the positions and table are the graph's own inputs.
        """
        b = positions.shape[0]
        consts = self._row_consts.get(b)
        if consts is None or consts[0].device != positions.device:
            dev = positions.device
            consts = (torch.arange(b, device=dev), torch.ones(b, dtype=torch.long, device=dev))
            self._row_consts[b] = consts
        rows, ones = consts
        bs = self.runner.cache.layout.block_size
        return AttentionTiles(rows, ones, rows, positions, table, bs, 1, self.splits(b, table.shape[1] * bs))

    def eager_tiles(self, inp: StepInput) -> AttentionTiles:
        """Tiles of an eager step: one per decode row, each prefill chunk cut into 16-row tiles."""
        bs = self.runner.cache.layout.block_size
        tables: list[list[int]] = []
        tiles: list[tuple[int, int, int, int]] = []  # (row, length, sequence, position)
        for i, r in enumerate(inp.decode):
            tables.append(r.blocks[: r.position // bs + 1])
            tiles.append((i, 1, i, r.position))
        row = len(inp.decode)
        for chunk in inp.prefill:
            n = len(chunk.token_ids)
            seq = len(tables)
            tables.append(chunk.blocks[: (chunk.start + n - 1) // bs + 1])
            tiles.extend(
                (row + k, min(EAGER_TILE_ROWS, n - k), seq, chunk.start + k)
                for k in range(0, n, EAGER_TILE_ROWS)
            )
            row += n
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), BlockPool.SCRATCH_BLOCK, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        dev = self.runner.device
        meta = torch.tensor(tiles, dtype=torch.long).t().contiguous().to(dev, non_blocking=True)
        return AttentionTiles(
            meta[0], meta[1], meta[2], meta[3], table.to(dev, non_blocking=True), bs, EAGER_TILE_ROWS
        )
