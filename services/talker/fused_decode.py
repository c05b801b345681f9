"""The talker's decode layers as fused kernels: 9 launches per layer instead of ~29.

Why: a talker decode step moves ~0.2 GB of weights (≈ 50 µs of HBM time) yet took 1.3 ms of GPU time on
the H200 as ~580 kernels of 1–8 µs each (BENCHMARKS.md, "Talker decode kernels"). Per layer this path runs: RMSNorm (the
residual add of the previous MLP folded in), the q|k|v GEMM, one kernel for rotary on q/k plus the K/V
store, paged attention straight over the slot cache, the o GEMM, residual add + RMSNorm, the gate|up
GEMM, SiLU·up, the down GEMM. Every kernel is shared with the thinker (:mod:`services.common.kernels`; its
rotary+store without the q/k norms Qwen3 has and Llama lacks): the talker cache ``[slots, context + 1, kv_heads, D]``
per layer is the thinker's token-major layout with one page of ``context + 1`` rows per slot, so its
paged kernel reads it through a one-column block table (page = slot).

The per-element arithmetic rounds where :meth:`TalkerRunner._layers` rounds (residual sums, the
normalised row before its weight, each rotary product, the SiLU before ·up); only attention differs by
its fp32 summation order (online softmax). The talker's ``kernels`` profile key (``--kernels``) =
``torch`` | ``triton`` | ``auto`` picks the backend (see :func:`select_backend`); the torch path stays the CPU/CI path and the
reference that tests and ``bench.cuda_smoke`` compare this one with.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.common.kernels import AttentionTiles, get_ops, key_splits, triton_usable
from services.talker.kv_cache import SlotKVCache

BACKENDS = ("torch", "triton")
# What ``auto`` picks on CUDA: the fused path, since the H200 run of ``bench.talker --kernels auto,triton``
# and ``bench.cuda_smoke --stages talker --graph-kernels triton`` (BENCHMARKS.md, "Talker decode kernels") found
# it 19 % / 11 % faster per stream at batch 1 / 16 and every difference a bf16 near-tie;
# ``kernels: torch`` in the profile keeps the torch path.
AUTO_ON_CUDA = "triton"


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """The talker's decode kernel backend for ``device``: ``requested`` (the profile's ``kernels`` key,
    ``--kernels``), else auto.

    ``auto`` is :data:`AUTO_ON_CUDA` on CUDA (when Triton imports) and ``torch`` elsewhere; ``triton`` on
    CPU needs ``TRITON_INTERPRET=1`` (tests).
    """
    want = (requested or "auto").strip().lower()
    if want not in (*BACKENDS, "auto"):
        raise ValueError(f"kernels must be one of torch, triton, auto (got {want!r})")
    if want == "auto":
        return AUTO_ON_CUDA if device.type == "cuda" and triton_usable(device) else "torch"
    if want == "triton" and not triton_usable(device):
        raise ValueError(
            f"the triton talker kernels need a CUDA device (or TRITON_INTERPRET=1), not {device}"
        )
    return want


class DecodeHost(Protocol):
    """What the fused loop uses of its runner (``TalkerRunner``): a protocol, so this module, which the
    runner imports, need not import the runner back."""

    device: torch.device
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: list[Any]  # the MiniCPMTTS decoder layers (their norms and o/down projections)
    final_norm: Any  # transformers' LlamaRMSNorm (weight, variance_epsilon)
    cache: SlotKVCache
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    _qkv_weights: list[torch.Tensor | None]
    _gate_up_weights: list[torch.Tensor | None]


class FusedDecode:
    """The fused decode layer loop of one runner (its weights, slot cache and RoPE tables)."""

    def __init__(self, runner: DecodeHost) -> None:
        self.runner = runner
        self.ops = get_ops("triton")
        dev = runner.device
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.rows = runner.context + 1  # cache rows per slot: one attention "page" per slot
        self._consts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def supports(runner: DecodeHost) -> bool:
        """Fused q|k|v and gate|up weights exist (bias-free projections, as in MiniCPM-o 4.5's talker)."""
        return all(w is not None for w in runner._qkv_weights) and all(
            w is not None for w in runner._gate_up_weights
        )

    def _row_consts(self, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row ids, ones, first cache row of each slot) for ``n`` rows, made once per batch size.

        Made during the warm-up passes that precede a capture, so a graph records fixed tensors.
        """
        consts = self._consts.get(n)
        if consts is None or consts[0].device != dev:
            rows = torch.arange(n, device=dev)
            consts = (rows, torch.ones(n, dtype=torch.long, device=dev), rows * self.rows)
            self._consts[n] = consts
        return consts

    def layers(
        self, x: torch.Tensor, rope_pos: torch.Tensor, write_index: torch.Tensor, read_len: int
    ) -> torch.Tensor:
        """Decode rows ``x [n, H]`` of slots ``0..n-1``; returns the final-norm hidden ``[n, H]``.

        Row ``b`` rotates at ``rope_pos[b]``, writes its K/V at cache index ``write_index[b]`` (the scratch
        row for idle rows) and attends to indices ``0..rope_pos[b]`` of its slot. ``read_len`` (the graph's
        length bucket) only sizes the key split of the attention kernel.
        """
        r = self.runner
        ops = self.ops
        n = x.shape[0]
        hq, hkv, d = r.num_heads, r.num_kv_heads, r.head_dim
        rows, ones, first_row = self._row_consts(n, x.device)
        tokens = first_row + write_index
        splits = key_splits(n, hkv, read_len, self.sms)
        tiles = AttentionTiles(rows, ones, rows, rope_pos, rows[:, None], self.rows, 1, splits)
        delta: torch.Tensor | None = None
        for i, layer in enumerate(r.layers):
            in_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
            if delta is None:
                h = ops.rms_norm(x, in_norm.weight, float(in_norm.variance_epsilon))
            else:
                x, h = ops.add_rms_norm(x, delta, in_norm.weight, float(in_norm.variance_epsilon))
            qkv_w, gate_up_w = r._qkv_weights[i], r._gate_up_weights[i]
            assert qkv_w is not None and gate_up_w is not None  # FusedDecode.supports
            qkv = F.linear(h, qkv_w)
            kc, vc = r.cache.k[i], r.cache.v[i]
            kc, vc = kc.view(-1, hkv, d), vc.view(-1, hkv, d)  # flat token rows slot·(context+1) + index
            q = ops.qk_rope_store(qkv, None, 0.0, r.cos_table, r.sin_table, rope_pos, tokens, kc, vc, hq, hkv)
            o = ops.paged_attention(q, kc, vc, tiles)
            attn_out = layer.self_attn.o_proj(o.view(n, hq * d))
            x, h = ops.add_rms_norm(x, attn_out, post_norm.weight, float(post_norm.variance_epsilon))
            delta = layer.mlp.down_proj(ops.silu_mul(F.linear(h, gate_up_w)))
        norm = r.final_norm
        if delta is None:
            return ops.rms_norm(x, norm.weight, float(norm.variance_epsilon))
        return ops.add_rms_norm(x, delta, norm.weight, float(norm.variance_epsilon))[1]
