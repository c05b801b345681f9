"""Executes one engine step of the Qwen3 LLM over the paged KV cache (eager, or a CUDA graph of rows).

The scheduler decides *what* runs; this module only runs it. A step is a packed set of tokens: the
decode rows of every running stream (one token each) followed by prefill chunks. Projections, norms
and MLPs run once over all packed tokens; attention reads each sequence's keys back from the cache:

* decode rows together, keys gathered into ``[B, L_max]`` with a validity mask;
* each prefill chunk on its own, with a causal mask offset by what the sequence already holds.

GQA without repeating K/V: the query heads that share one KV head are folded into the query-length
axis (``[Hkv, G*n, D]``), so SDPA sees as many heads as the cache has and the mask rows repeat per group.

We call the transformers Qwen3 layers' own submodules (projections, q/k norms, MLP, RMSNorms) so the
arithmetic is the checkpoint's, and replace only the attention/cache plumbing. Rotary cos/sin come from
a table built with the model's own ``inv_freq`` and scaling, indexed by position (graph-safe).

CUDA graphs: a step of at most 128 tokens (decode rows plus prefill chunks of any length, such as a
duplex unit's ~13 or a unit that opens a turn with its instructions) runs as "rows": a prefill token is a
row at its own position, and since every row's key/value is written before any row attends to it, the
chunk's tokens see each other causally as in a chunked prefill.
Such a step replays a graph captured per (row bucket, context bucket) (:mod:`services.thinker.row_graph`);
padded rows write to the pool's scratch block and attend to one masked-in scratch slot, so they cannot
touch real sequences. A step with prefill never waits for a capture (it runs eagerly when its bucket is
missing); larger steps and long contexts run eagerly. CPU always runs eagerly.

The per-layer arithmetic lives in :mod:`services.thinker.layer_ops`. This file stays a little over
500 lines on purpose: the eager step, the row packing and the graph lookup share the attention plan and
the rotary tables, and splitting them would make each step path read across modules.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.common.kernels import (
    get_ops,
    norm_fold_enabled,
    read_cache_rows,
    select_backend,
    write_cache_rows,
)
from services.common.kernels.fp8_quant import Fp8Weight
from services.thinker.fp8_weights import check_weights, quantize_runner
from services.thinker.fp8_weights import head_logits as fp8_head_logits
from services.thinker.fused_forward import FusedForward
from services.thinker.kv_cache import BlockPool, PagedKVCache
from services.thinker.layer_ops import (
    FusedLayer,
    fold_norm_weights,
    foldable,
    fuse_rows,
    post_attention,
    pre_attention,
)
from services.thinker.row_graph import Capture, RowGraph, fill_rows
from services.thinker.step_types import DecodeRow, PrefillChunk, StepInput, StepOutput

log = logging.getLogger(__name__)

SCRATCH_SLOT = BlockPool.SCRATCH_BLOCK  # slot 0 lives in the scratch block


@dataclass
class _AttnPlan:
    """Index tensors that tell attention where each row's context lives in the cache."""

    num_decode: int
    decode_gather: torch.Tensor | None = None  # [B, L] slot ids
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (row_start, n, gather [L], mask [G*n, L])


def _next_pow2(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


# How a step's forward ran: a graph replay of decode rows, a replay with prefill chunks packed as rows,
# or the eager layer loop (a step too large for the row graphs, a long context, CPU).
STEP_PATHS = ("graph", "graph_mixed", "eager")


class ModelRunner:
    """Owns the forward pass and the CUDA graphs; knows nothing about requests or sampling."""

    GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
    GRAPH_MIN_CONTEXT = 256
    GRAPH_MAX_CONTEXT = 16384
    # Steps of at most this many tokens (decode rows plus prefill chunks) can replay a row graph.
    # Why 128: with 16-24 duplex sessions a step carries their decode rows plus the units that arrived
    # together (13 tokens each: 16 + 3 x 13 = 55 rows) or a unit that opens a turn (50-140 tokens); run
    # eagerly, such a step is 28-90 ms of host-bound launches against ~12 ms for a replay, and every
    # session's decode waits on it. Chunks may be as long as the step: above 32 rows the graph attends in
    # two launches (services.thinker.fused_forward.ROPE_ATTENTION_MAX_ROWS).
    PACKED_MAX_ROWS = 128

    def __init__(
        self,
        llm: nn.Module,
        cache: PagedKVCache,
        *,
        use_cuda_graphs: bool = True,
        compile_layers: bool = False,
        kernels: str | None = None,
        norm_fold: bool | None = None,
        weights: str = "bf16",
    ) -> None:
        # transformers' Qwen3ForCausalLM, its decoder and config, read by attribute name (typed loosely).
        qwen: Any = llm
        self.llm: Any = qwen
        self.model: Any = qwen.model
        self.cache = cache
        self.device = cache.device
        cfg = qwen.config
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.group = self.num_heads // self.num_kv_heads
        self.max_positions = int(cfg.max_position_embeddings)
        self.dtype: torch.dtype = self.model.embed_tokens.weight.dtype
        self.cos, self.sin = self._rope_tables()
        self.layers = [self._fuse(layer) for layer in self.model.layers]
        # Optional torch.compile of the two pure per-layer blocks (norms, rotary, SwiGLU fused into a few
        # kernels around the GEMMs). One compiled function serves every layer (same shapes, other weights).
        self._pre, self._post = pre_attention, post_attention
        if compile_layers:
            self._pre = torch.compile(pre_attention, dynamic=True)
            self._post = torch.compile(post_attention, dynamic=True)
        self.use_cuda_graphs = bool(use_cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], RowGraph] = {}
        self._fold_request = norm_fold  # None: on with CUDA + Triton
        # weights: fp8 (services.thinker.fp8_weights): the lm_head in e4m3 when the GEMMs run in fp8.
        self.weights = "bf16"
        self.head_fp8: Fp8Weight | None = None
        self.kernel_backend: str = ""
        self.norm_fold = False
        self.set_kernels(kernels)
        self.fused = FusedForward(self)
        if check_weights(weights) == "fp8":
            self.quantize_weights()
        # How steps ran (STEP_PATHS): "graph" (decode rows only), "graph_mixed" (rows with a prefill
        # chunk), "eager"; count_step keeps the counts and the last step's path (the engine's metric label).
        self.step_counts: dict[str, int] = dict.fromkeys(STEP_PATHS, 0)
        self.last_path = "eager"
        self._graph_pool = None
        self._row_logits: dict[int, torch.Tensor] = {}  # row bucket -> the logits its graphs share
        self.graphs_warmed = False  # set by warmup_graphs: a capture after it is logged as a stall
        self.graph_capture: Capture | None = None  # None: real CUDA graphs (tests emulate them on CPU)

    def set_kernels(self, kernels: str | None) -> None:
        """Choose the kernel backend (``torch`` | ``triton`` | ``auto``/None, see services.common.kernels).

        Only before any graph is captured: a captured graph keeps the kernels it recorded.
        """
        if self._graphs:
            raise RuntimeError("set_kernels after a CUDA graph was captured")
        backend = select_backend(self.device, kernels)
        if self.weights != "bf16" and backend != self.kernel_backend:
            raise RuntimeError(
                "the kernel backend is fixed once the weights are quantized (laid out per backend)"
            )
        self.kernel_backend = backend
        self.ops = get_ops(self.kernel_backend)
        self._apply_norm_fold()
        if self.kernel_backend != "torch" and self._pre is not pre_attention:
            log.info(
                "--compile has no effect with the %s kernels (they are fused already)", self.kernel_backend
            )
        log.info(
            "thinker kernels: %s (folded norms %s)",
            self.kernel_backend,
            self.norm_fold,
        )

    def set_norm_fold(self, enabled: bool | None) -> None:
        """Turn the folded-norm decode loop on/off (None: the default, on with CUDA), before any capture.

        Folding the weights is one-way (the module keeps computing the same function); turning the loop
        off again runs the norm kernels with the folded weights and ones as norm weights (same kernels and
        launches as an unfolded model, which is what a benchmark A/B needs).
        """
        if self._graphs:
            raise RuntimeError("set_norm_fold after a CUDA graph was captured (drop_graphs first)")
        self._fold_request = enabled
        self._apply_norm_fold()

    def _apply_norm_fold(self) -> None:
        want = norm_fold_enabled(self.device, self.kernel_backend, self._fold_request)
        self.norm_fold = want and all(foldable(lay) for lay in self.layers)
        if self.norm_fold and self.head_fp8 is not None:
            decoder: Any = self.model
            if not all(getattr(layer, "_thinker_norms_folded", False) for layer in decoder.layers):
                raise RuntimeError("fp8 weights: the norms can only be folded before quantization")
            return
        if self.norm_fold:
            folded = sum(
                fold_norm_weights(layer, lay)
                for layer, lay in zip(self.model.layers, self.layers, strict=True)
            )
            if folded:
                log.info("folded the RMSNorm weights of %d thinker layers into their GEMMs", folded)

    def quantize_weights(self) -> None:
        """Switch the projection weights and the lm_head to fp8 (``weights: fp8``), before any capture.

        One-way: see :func:`services.thinker.fp8_weights.quantize_runner` (after the norm folding, which
        is decided by then).
        """
        if self._graphs:
            raise RuntimeError("quantize_weights after a CUDA graph was captured (drop_graphs first)")
        if self.weights == "fp8":
            return
        quantize_runner(self)
        self.weights = "fp8"

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over ``hidden [rows, hidden]`` (fp8 when the GEMMs run in fp8)."""
        if self.head_fp8 is not None:
            return fp8_head_logits(self, hidden)
        return self.llm.lm_head(hidden)

    def drop_graphs(self) -> None:
        """Forget every captured graph (benchmarks A/B kernel settings); only between steps, none in flight."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs.clear()
        self._row_logits.clear()
        # The pool dies with its last graph: capturing into its stale handle again tripped the caching
        # allocator's assert on the H200 (use_count > 0), so the next capture makes a fresh pool.
        self._graph_pool = None

    def _fuse(self, layer: Any) -> FusedLayer:
        # ``layer``: a transformers Qwen3DecoderLayer, read by attribute name.
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_w, _ = fuse_rows([mlp.gate_proj, mlp.up_proj])
        qk_norm = torch.cat(
            [
                attn.q_norm.weight.detach().expand(self.num_heads, self.head_dim),
                attn.k_norm.weight.detach().expand(self.num_kv_heads, self.head_dim),
            ]
        )
        if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            raise ValueError("q_norm and k_norm must share one epsilon to be fused")
        if getattr(layer.mlp.config, "hidden_act", "silu") != "silu":
            raise ValueError("the thinker runner implements the SwiGLU MLP of Qwen3 (hidden_act silu)")
        return FusedLayer(
            input_norm_weight=layer.input_layernorm.weight,
            input_eps=float(layer.input_layernorm.variance_epsilon),
            qkv_weight=qkv_w,
            qkv_bias=qkv_b,
            qk_norm_weight=qk_norm,
            qk_eps=float(attn.q_norm.variance_epsilon),
            o_weight=attn.o_proj.weight,
            o_bias=attn.o_proj.bias,
            post_norm_weight=layer.post_attention_layernorm.weight,
            post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            gate_up_weight=gate_up_w,
            down_weight=mlp.down_proj.weight,
        )

    # ------------------------------------------------------------------------------------------ rope
    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Recompute inv_freq in fp32 from the config: a model cast to bf16 also casts its rotary buffer,
        # which would shift every angle; the reference computes them in fp32.
        rotary = self.model.rotary_emb
        cfg = self.llm.config
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", getattr(rotary, "rope_type", "default"))
        if rope_type == "default":
            base = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
            steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32)
            inv_freq = 1.0 / (base ** (steps / self.head_dim))
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, self.device)
        inv_freq = inv_freq.to(device=self.device, dtype=torch.float32)
        pos = torch.arange(self.max_positions, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    # --------------------------------------------------------------------------------------- forward
    def _layers_forward(
        self, x: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor, plan: _AttnPlan
    ) -> torch.Tensor:
        """Run every decoder layer over packed rows ``x [T, hidden]``; returns final-norm hidden."""
        t = x.shape[0]
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.sin.index_select(0, positions)[:, None, :]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        for idx, lay in enumerate(self.layers):
            q, k, v = self._pre(
                x,
                lay.input_norm_weight,
                lay.input_eps,
                lay.qkv_weight,
                lay.qkv_bias,
                lay.qk_norm_weight,
                lay.qk_eps,
                cos,
                sin,
                hq,
                hkv,
            )
            k_cache, v_cache = self.cache.k[idx], self.cache.v[idx]
            write_cache_rows(k_cache, write_slots, k)
            write_cache_rows(v_cache, write_slots, v)
            o = self._attend(q, k_cache, v_cache, plan)
            x = self._post(
                x,
                o.reshape(t, hq * d),
                lay.o_weight,
                lay.o_bias,
                lay.post_norm_weight,
                lay.post_eps,
                lay.gate_up_weight,
                lay.down_weight,
            )
        return self.model.norm(x)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _AttnPlan
    ) -> torch.Tensor:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        parts: list[torch.Tensor] = []
        b = plan.num_decode
        if b:
            assert plan.decode_gather is not None and plan.decode_mask is not None
            qd = q[:b].view(b, hkv, g, d)
            kd = read_cache_rows(k_cache, plan.decode_gather, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
            vd = read_cache_rows(v_cache, plan.decode_gather, q.dtype).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)
            parts.append(od.reshape(b, self.num_heads, d))
        for start, n, gather, mask in plan.prefill:
            qc = q[start : start + n].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)
            kc = read_cache_rows(k_cache, gather, q.dtype).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
            vc = read_cache_rows(v_cache, gather, q.dtype).permute(1, 0, 2).unsqueeze(0)
            oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask)
            parts.append(oc.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, self.num_heads, d))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # ------------------------------------------------------------------------------------------ plan
    def _slot_tensor(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache slots of positions ``[start, end)`` of a sequence (host tensor, vectorised)."""
        bs = self.cache.layout.block_size
        table = torch.tensor(blocks, dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def _decode_host(
        self, rows: list[DecodeRow], pad_batch: int, pad_blocks: int
    ) -> tuple[torch.Tensor, ...]:
        """Small host tensors for decode rows: ids, positions, write slots, block tables (padded).

        Padded rows use position 0 and the scratch block, so they write to and read from scratch only.
        """
        host = torch.empty(pad_batch * (3 + pad_blocks), dtype=torch.long)
        fill_rows(rows, self.cache.layout.block_size, host.numpy(), pad_batch, pad_blocks)
        b = pad_batch
        return host[:b], host[b : 2 * b], host[2 * b : 3 * b], host[3 * b :].view(b, pad_blocks)

    def _decode_attn_plan(self, pos: torch.Tensor, table: torch.Tensor) -> _AttnPlan:
        """Device-side gather indices and validity mask from block tables (graph-safe, no host loops)."""
        bs = self.cache.layout.block_size
        length = table.shape[1] * bs
        offsets = torch.arange(length, device=table.device)
        valid = offsets[None, :] <= pos[:, None]  # [B, L]; padded rows: position 0 only
        gather = table.repeat_interleave(bs, dim=1) * bs + offsets % bs
        # Masked positions read the (zeroed) scratch slot: never-written cache memory may hold NaN, and
        # a masked NaN still poisons the output (0 * NaN).
        gather = torch.where(valid, gather, SCRATCH_SLOT)
        return _AttnPlan(num_decode=pos.shape[0], decode_gather=gather, decode_mask=valid[:, None, None, :])

    # ------------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self, inp: StepInput) -> StepOutput:
        if self.use_cuda_graphs:
            packed = self.pack_rows(inp)
            if packed is not None:
                rows, embeds = packed
                # A step with prefill never waits for a capture: it runs eagerly if its bucket is missing.
                graph = self._graph_for(len(rows), max(r.position + 1 for r in rows), capture=not inp.prefill)
                if graph is not None:
                    hidden, logits = graph.run(rows, embeds)
                    self.count_step("graph_mixed" if inp.prefill else "graph")
                    return self._row_output(inp, hidden, logits, clone=True, tokens=graph.tokens)
        self.count_step("eager")
        return self._eager_step(inp)

    def count_step(self, path: str) -> None:
        """Record that a step ran on ``path`` (one of :data:`STEP_PATHS`)."""
        self.step_counts[path] += 1
        self.last_path = path

    def pack_rows(self, inp: StepInput) -> tuple[list[DecodeRow], list[tuple[int, torch.Tensor]]] | None:
        """The step as decode-style rows (a prefill token is a row at its own position), or None if too big.

        A row writes its key/value before any row attends (per layer), and attends to positions up to its
        own, so the tokens of a prefill chunk see each other causally exactly as in a chunked prefill.
        Steps of decode rows and prefill chunks (a duplex unit is ~13 tokens) up to :attr:`PACKED_MAX_ROWS`
        rows in all then replay a captured graph instead of running eagerly. Returns the rows and the embedding overrides ``(first row, [n, hidden])``.
        """
        total = inp.num_tokens
        if not total or total > self.PACKED_MAX_ROWS:
            return None
        rows = list(inp.decode)
        embeds: list[tuple[int, torch.Tensor]] = []
        for chunk in inp.prefill:
            if chunk.embeds is not None:
                embeds.append((len(rows), chunk.embeds))
            rows.extend(
                DecodeRow(tok, chunk.start + i, chunk.blocks) for i, tok in enumerate(chunk.token_ids)
            )
        return rows, embeds

    def packed_step_eager(self, inp: StepInput) -> StepOutput:
        """The packed-row step without a graph (what a replay computes); tests compare it with the eager step."""
        packed = self.pack_rows(inp)
        if packed is None:
            raise ValueError(f"a step of {inp.num_tokens} tokens does not fit {self.PACKED_MAX_ROWS} rows")
        rows, embeds = packed
        bs = self.cache.layout.block_size
        host = self._decode_host(rows, len(rows), max(r.position // bs + 1 for r in rows))
        ids, pos, write, table = (t.to(self.device) for t in host)
        override, use = self._embed_override(len(rows), embeds)
        with torch.inference_mode():
            hidden, logits = self.decode_forward_static(ids, pos, write, table, override, use)
        return self._row_output(inp, hidden, logits, clone=False)

    def _embed_override(
        self, batch: int, embeds: list[tuple[int, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        override = torch.zeros(batch, self.hidden_size, dtype=self.dtype, device=self.device)
        use = torch.zeros(batch, dtype=torch.bool, device=self.device)
        for row, e in embeds:
            override[row : row + e.shape[0]] = e.to(device=self.device, dtype=self.dtype)
            use[row : row + e.shape[0]] = True
        return override, use

    @staticmethod
    def _row_output(
        inp: StepInput,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        *,
        clone: bool,
        tokens: torch.Tensor | None = None,
    ) -> StepOutput:
        """Split packed-row outputs back into decode rows and per-chunk last-row logits (copies).

        ``tokens`` (a graph's in-graph argmax of every row) become ``greedy_tokens`` in sampling order.
        """
        b = len(inp.decode)
        prefill_logits: list[torch.Tensor | None] = []
        last_rows: list[int] = []
        prefill_hidden: list[torch.Tensor | None] = []
        row = b
        for chunk in inp.prefill:
            start = row
            row += len(chunk.token_ids)
            prefill_logits.append(logits[row - 1].to(torch.float32, copy=True) if chunk.want_logits else None)
            prefill_hidden.append(hidden[start:row].clone() if chunk.want_hidden else None)
            if chunk.want_logits:
                last_rows.append(row - 1)
        decode_hidden = hidden[:b].clone() if clone else hidden[:b]
        greedy = None
        if tokens is not None:
            greedy = tokens[:b]
            if last_rows:
                index = torch.tensor(list(range(b)) + last_rows, device=tokens.device)
                greedy = tokens.index_select(0, index)
        decode_logits = logits[:b].to(torch.float32, memory_format=torch.contiguous_format, copy=clone)
        return StepOutput(decode_hidden, decode_logits, prefill_logits, greedy, prefill_hidden)

    def _eager_step(self, inp: StepInput) -> StepOutput:
        dev = self.device
        b = len(inp.decode)
        plan = _AttnPlan(num_decode=b)
        torch_attention = self.kernel_backend == "torch"  # else the fused path builds its own tiles
        ids_parts: list[torch.Tensor] = []
        pos_parts: list[torch.Tensor] = []
        write_parts: list[torch.Tensor] = []
        if b:
            bs = self.cache.layout.block_size
            max_blocks = max(r.position // bs + 1 for r in inp.decode)
            ids, pos, write, table = self._decode_host(inp.decode, b, max_blocks)
            if torch_attention:
                plan = self._decode_attn_plan(
                    pos.to(dev, non_blocking=True), table.to(dev, non_blocking=True)
                )
            ids_parts.append(ids)
            pos_parts.append(pos)
            write_parts.append(write)
        row = b
        for chunk in inp.prefill:
            n = len(chunk.token_ids)
            end = chunk.start + n
            gather = self._slot_tensor(chunk.blocks, 0, end)
            if torch_attention:
                allowed = torch.arange(end)[None, :] <= (chunk.start + torch.arange(n))[:, None]
                mask = allowed.repeat(self.group, 1)
                plan.prefill.append(
                    (row, n, gather.to(dev, non_blocking=True), mask.to(dev, non_blocking=True))
                )
            ids_parts.append(torch.tensor(chunk.token_ids, dtype=torch.long))
            pos_parts.append(torch.arange(chunk.start, end, dtype=torch.long))
            write_parts.append(gather[chunk.start :])
            row += n
        ids = torch.cat(ids_parts).to(dev, non_blocking=True)
        positions = torch.cat(pos_parts).to(dev, non_blocking=True)
        write = torch.cat(write_parts).to(dev, non_blocking=True)
        x = self.model.embed_tokens(ids)
        row = b
        for chunk in inp.prefill:
            n = len(chunk.token_ids)
            if chunk.embeds is not None:  # the chunk's first rows (all of them, or a voice's prefix)
                x[row : row + chunk.embeds.shape[0]] = chunk.embeds.to(device=dev, dtype=x.dtype)
            row += n
        if torch_attention:
            hidden = self._layers_forward(x, positions, write, plan)
        else:
            hidden = self.fused.layers(x, positions, write, self.fused.eager_tiles(inp))
        # Logits only where a next token is drawn: every decode row and the last row of chunks that ask.
        want = list(range(b))
        row = b
        for chunk in inp.prefill:
            row += len(chunk.token_ids)
            if chunk.want_logits:
                want.append(row - 1)
        logits = self.head(hidden[want]).float() if want else hidden.new_zeros((0, 1))
        prefill_logits: list[torch.Tensor | None] = []
        prefill_hidden: list[torch.Tensor | None] = []
        k = b
        row = b
        for chunk in inp.prefill:
            n = len(chunk.token_ids)
            prefill_hidden.append(hidden[row : row + n] if chunk.want_hidden else None)
            row += n
            if chunk.want_logits:
                prefill_logits.append(logits[k])
                k += 1
            else:
                prefill_logits.append(None)
        return StepOutput(
            decode_hidden=hidden[:b],
            decode_logits=logits[:b],
            prefill_logits=prefill_logits,
            prefill_hidden=prefill_hidden,
        )

    # ------------------------------------------------------------------------------------ cuda graphs
    def _graph_for(self, batch: int, context: int, *, capture: bool = True) -> RowGraph | None:
        bb = next((x for x in self.GRAPH_BATCH_BUCKETS if x >= batch), None)
        if bb is None:
            return None
        if context > self.GRAPH_MAX_CONTEXT:
            return None  # long contexts decode eagerly: a graph would gather the whole bucket every step
        lb = _next_pow2(context, self.GRAPH_MIN_CONTEXT)
        key = (bb, lb)
        graph = self._graphs.get(key)
        if graph is None and not capture:
            return None
        if graph is None:
            t0 = time.perf_counter()
            graph = RowGraph(self, bb, lb)
            self._graphs[key] = graph
            ms = 1e3 * (time.perf_counter() - t0)
            if self.graphs_warmed:
                # A capture while serving stalls every stream of the step (seconds when it compiles a
                # kernel variant): a --graph-warmup-context below the contexts served leaves such gaps.
                log.warning(
                    "captured decode CUDA graph batch=%d context=%d while serving: %.0f ms", bb, lb, ms
                )
            else:
                log.info("captured decode CUDA graph batch=%d context=%d in %.0f ms", bb, lb, ms)
        return graph

    def row_logits_buffer(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """The ``[batch, vocab]`` logits buffer shared by the row graphs of one row bucket (see RowGraph)."""
        buf = self._row_logits.get(batch)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self._row_logits[batch] = buf
        return buf

    def warmup_graphs(self, max_batch: int, max_context: int, max_step_tokens: int = 16) -> int:
        """Capture every (batch, context) bucket up to ``max_batch`` x ``max_context`` now; returns the count.

        Captures are otherwise lazy, and one takes seconds on a full-size model (two eager warm-up passes
        plus the recording): a first request in a new bucket would stall every running stream that long.
        First one eager step of ``max_step_tokens`` tokens (the largest a burst of prompts can make) runs
        as 16-token chunks, ``max_batch`` of them asking for logits: it compiles the eager kernel
        variants (a first prefill would JIT-compile them while serving) and leaves the allocator holding
        blocks of a full step's sizes, so the first burst after start pays no device allocations. Every
        chunk sits at positions 0..15 of the scratch block, which only ever needs finite values.
        """
        if not self.use_cuda_graphs or max_batch < 1 or max_context < 1:
            return 0
        self._eager_step(self.burst_warmup_step(max_batch, max_step_tokens))
        # Steps that pack prefill chunks use row buckets up to PACKED_MAX_ROWS whatever max_batch is.
        max_batch = max(max_batch, self.PACKED_MAX_ROWS)
        top_batch = next(
            (x for x in self.GRAPH_BATCH_BUCKETS if x >= max_batch), self.GRAPH_BATCH_BUCKETS[-1]
        )
        top_context = min(_next_pow2(max_context, self.GRAPH_MIN_CONTEXT), self.GRAPH_MAX_CONTEXT)
        count = 0
        for batch in (b for b in self.GRAPH_BATCH_BUCKETS if b <= top_batch):
            context = self.GRAPH_MIN_CONTEXT
            while context <= top_context:
                self._graph_for(batch, context)
                count += 1
                context *= 2
        self.graphs_warmed = True
        return count

    @staticmethod
    def burst_warmup_step(max_batch: int, max_step_tokens: int) -> StepInput:
        """The eager warm-up step: ``max_step_tokens`` (at least 16) tokens as 16-token scratch chunks."""
        chunks = max(1, max_step_tokens // 16)
        scratch = [BlockPool.SCRATCH_BLOCK]
        return StepInput(
            prefill=[PrefillChunk([0] * 16, 0, scratch, None, i < max_batch) for i in range(chunks)]
        )

    def decode_forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write: torch.Tensor,
        table: torch.Tensor,
        embeds: torch.Tensor | None = None,
        use_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row forward over fixed-shape device tensors (the body a CUDA graph records).

        ``table`` [B, blocks] are padded block tables; gather indices and masks are derived on device.
        Rows with ``use_embeds`` take ``embeds`` (audio/vision rows of a prefill chunk) instead of the
        token embedding.
        """
        x = self.model.embed_tokens(ids)
        if embeds is not None and use_embeds is not None:
            x = torch.where(use_embeds[:, None], embeds, x)
        if self.kernel_backend == "torch":
            hidden = self._layers_forward(x, positions, write, self._decode_attn_plan(positions, table))
        else:
            tiles = self.fused.row_tiles(positions, table)
            hidden = self.fused.layers(x, positions, write, tiles, packed=True)
            if self.head_fp8 is not None:
                return hidden, fp8_head_logits(self, hidden)
            return hidden, self.fused.head_logits(hidden, self.llm.lm_head)
        return hidden, self.llm.lm_head(hidden)


def build_qwen3_llm(
    config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> nn.Module:
    """A transformers ``Qwen3ForCausalLM`` from the flat checkpoint config and ``llm.``-stripped weights.

    Used when the full thinker model (vision/audio towers) is not needed, e.g. text-only tests and the
    benchmark; the multimodal path takes ``ThinkerModel.llm`` instead.
    """
    from transformers import Qwen3ForCausalLM

    from services.thinker.model.config import qwen3_config_from_checkpoint

    qcfg = qwen3_config_from_checkpoint(config)
    if qcfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    # Any: transformers wraps PreTrainedModel.to with functools.wraps, whose type hides the bound self.
    llm: Any
    with torch.device("meta"):
        llm = Qwen3ForCausalLM(qcfg)
    llm.load_state_dict(tensors, strict=True, assign=True)
    # Non-persistent buffers (rotary inv_freq) are not in the checkpoint and were created on meta.
    llm.model.rotary_emb = type(llm.model.rotary_emb)(qcfg)
    llm = llm.to(device=device, dtype=dtype)
    llm.model.rotary_emb = type(llm.model.rotary_emb)(qcfg).to(device)  # keep inv_freq in fp32
    return llm.eval().requires_grad_(False)
