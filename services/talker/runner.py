"""Forward passes of the Talker backbone over the static slot cache: one-stream prefill, batched decode.

The backbone weights are transformers' ``LlamaModel`` modules (q/k/v/o projections, RMSNorms, MLP) and
the arithmetic per element is the library's, done in fewer kernels (fused q|k|v and gate|up GEMMs,
RoPE/mask/KV indices once per step, fused RMSNorm); what this module adds is the cache discipline
(:mod:`kv_cache`) that lets many streams at different positions decode in one batched step:

* ``prefill(slot, rows)`` runs one stream's condition (any length) starting at its current cache length,
  writes K/V at those positions, and returns the logits of the last row;
* ``decode_sample(slots, codes, rows)`` feeds one codec id for each of the slots ``0..n-1`` at once and
  samples each row's next id in the same step (:func:`sampling.sample_packed`); each row writes its K/V
  at its own position and attends to its own prefix only (a per-row mask). Rows that sit out the step
  write to the cache's scratch column and their outputs are ignored. ``decode`` returns logits only.

On CUDA the decode+sample step is captured once per (batch bucket, attention-length bucket) into a CUDA
graph and replayed, with one small copy in and the picked ids out; on CPU (tests) the same function
runs eagerly. Buckets are powers of two so a handful of
graphs cover every batch size and context length.

The batched prefill of conditions up to ``PREFILL_WIDTHS[-1]`` rows is graphed too (CUDA; tests emulate
the replay): padded to a (streams, rows, attention length) bucket of at most ``PREFILL_GRAPH_KEYS`` key
rows, it replays one graph of a :class:`~services.common.cuda_graphs.ShapeKeyedGraphs` set captured at
start-up and then frozen. Why: run eagerly, a prefill is several hundred small launches; at 16 duplex
sessions the talker logged 28–56 ms prefills of 1–8 new streams in front of every stream's decode, most
of the time between a unit's text and its first codec window. Longer conditions (whole utterances,
rollover windows) and larger buckets prefill eagerly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.common.cuda_graphs import Capture, ShapeKeyedGraphs, SharedBuffers, capture_cuda_graph
from services.common.device import to_device
from services.common.sdpa import attention
from services.talker import sampling as smp
from services.talker.fused_decode import FusedDecode, select_backend
from services.talker.kv_cache import SlotKVCache
from services.talker.model.tts import MiniCPMTTS

log = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 64
# Row buckets of a graphed prefill (a condition is one unit's or chunk's text: a few to a few tens of rows).
PREFILL_WIDTHS = (16, 32, 64)
# Most key rows (streams × attention length) a graphed prefill reads. Its attention gathers each stream's
# K and V ([streams, length, heads, head dim] per layer) inside the graph pool, which keeps its peak for
# good: at 8192 that is 25 MB per layer at full size (12 heads × 64, bf16), against 96 MB for 8 streams at
# 4096, while the talker's headroom beside its slots had ~0.1 GiB to spare (kv_cache.SLOT_HEADROOM_BYTES).
# Larger products (8 streams past 1024 positions, 4 past 2048) prefill eagerly.
PREFILL_GRAPH_KEYS = 8192


class BlockGraphs(Protocol):
    """What the runner does with the K-step decoder's graphs (:class:`services.talker.multistep.BlockDecoder`,
    which imports this module: a protocol, so the runner need not import it back)."""

    def clear(self) -> None: ...

    def warmup(self, batches: Sequence[int], lengths: Sequence[int]) -> int: ...


def next_bucket(value: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ max(value, minimum)."""
    b = max(1, minimum)
    while b < value:
        b *= 2
    return b


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers ``LlamaRMSNorm`` arithmetic in two kernels: fused normalisation, then × weight.

    ``F.rms_norm`` without a weight computes ``x·rsqrt(mean(x²) + eps)`` in fp32 and rounds once to
    ``x.dtype`` — the same single rounding as transformers' fp32 product followed by ``.to(dtype)``;
    the weight product then happens in ``x.dtype`` as in transformers.
    """
    return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.variance_epsilon)


def _fuse_rows(modules: list[torch.nn.Linear], tag: str, owner: torch.nn.Module) -> torch.Tensor | None:
    """One weight [sum(out), in] for several bias-free projections; the modules then view into it.

    Idempotent (several runners may share one model) and memory-neutral: the original weights become
    views of the fused tensor, so nothing is stored twice. Returns None when a projection has a bias.
    """
    fused = getattr(owner, tag, None)
    if fused is not None:
        return fused
    if any(m.bias is not None for m in modules):
        return None
    with torch.no_grad():
        fused = torch.cat([m.weight.detach() for m in modules], dim=0).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    setattr(owner, tag, fused)
    return fused


class TalkerRunner:
    """Owns the model, the slot cache, the RoPE tables and (on CUDA) the decode graphs."""

    def __init__(
        self,
        model: MiniCPMTTS,
        *,
        num_slots: int,
        use_cuda_graphs: bool | None = None,
        kernels: str | None = None,
    ) -> None:
        """``kernels``: decode backend, ``torch`` | ``triton`` | ``auto`` (:func:`fused_decode.select_backend`)."""
        self.model = model
        cfg = model.cfg
        self.cfg = cfg
        self.device = model.device
        self.dtype = model.dtype
        self.context = cfg.max_position_embeddings
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # transformers' Llama decoder layers and final norm, read by attribute name (typed loosely).
        self.layers: list[Any] = list(model.model.layers)
        self.final_norm: Any = model.model.norm
        self.cache = SlotKVCache(
            num_layers=len(self.layers),
            num_slots=num_slots,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            context=self.context,
            dtype=self.dtype,
            device=self.device,
        )
        # RoPE table for every position (+ scratch): the same fp32 product and cos/sin transformers uses.
        inv_freq = model.model.rotary_emb.inv_freq.to(device=self.device, dtype=torch.float32)
        positions = torch.arange(self.context + 1, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
        self.cos_table = (emb.cos() * scaling).to(self.dtype)
        sin = (emb.sin() * scaling).to(self.dtype)
        self.sin_table = sin  # the fused decode kernel applies rotate_half's sign itself
        # rotate_half(x)·sin == roll(x, D/2)·[−sin₁, sin₂]: the negation moves into the table (exact).
        half = sin.shape[-1] // 2
        self.sin_signed_table = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        # Fused projections (q|k|v, gate|up): fewer, larger GEMMs per layer in the decode graph.
        self._qkv_weights = [
            _fuse_rows(
                [la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj], "talker_qkv", la.self_attn
            )
            for la in self.layers
        ]
        self._gate_up_weights = [
            _fuse_rows([la.mlp.gate_proj, la.mlp.up_proj], "talker_gate_up", la.mlp) for la in self.layers
        ]
        self.kernels = select_backend(self.device, kernels)
        self._fused: FusedDecode | None = None
        if self.kernels == "triton":
            if FusedDecode.supports(self):
                self._fused = FusedDecode(self)
            else:
                log.warning("talker projections have biases: the fused decode kernels are off")
                self.kernels = "torch"
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.use_cuda_graphs = bool(use_cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        vocab = cfg.num_audio_tokens
        # Sampler constants made once, outside any capture; idle rows: greedy, nothing applied.
        self.vocab_salt = smp.vocab_salt(vocab, self.device)
        idle_ints, idle_floats = smp.idle_row(vocab)
        self._idle_ints: list[int] = idle_ints
        self._idle_floats: list[float] = idle_floats
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        # K decode steps per replay (:mod:`multistep`); the engine attaches it when K > 1, and
        # :meth:`warmup_graphs` then captures its graphs too.
        self.blocks: BlockGraphs | None = None
        # Graphed batched prefill (:meth:`enable_prefill_graphs`): on with the decode graphs.
        self.prefill_graphs: ShapeKeyedGraphs | None = None
        self.prefill_graph_batch = 0  # the largest batch bucket the set covers
        self._cols: dict[int, torch.Tensor] = {}  # attention-length bucket -> arange (a graph input)
        if self.use_cuda_graphs:
            self.enable_prefill_graphs()

    # ----------------------------------------------------------------------------------- attention
    def _attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_index: tuple[torch.Tensor, torch.Tensor],
        read_slots: slice | torch.Tensor,
        read_len: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, T, H]; K/V of each (row, t) go to cache[layer, slot, position] per ``kv_index``.

        One projection GEMM for q|k|v and one RoPE pass over q|k together; per element the arithmetic
        is transformers' (``x·cos + rotate_half(x)·sin``, the sign of ``rotate_half`` folded into sin).
        """
        attn = self.layers[layer_idx].self_attn
        bsz, seq, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_w = self._qkv_weights[layer_idx]
        if qkv_w is not None:
            qkv = F.linear(x, qkv_w).view(bsz, seq, hq + 2 * hkv, d)
        else:
            qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1).view(
                bsz, seq, hq + 2 * hkv, d
            )
        cos, sin_signed = rope  # [B, T, 1, D]
        qk = qkv[:, :, : hq + hkv]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin_signed
        q = qk[:, :, :hq].transpose(1, 2)
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [slots, context + 1, Hkv, D]
        kc.index_put_(kv_index, qk[:, :, hq:])
        vc.index_put_(kv_index, qkv[:, :, hq + hkv :])
        keys = kc[read_slots, :read_len].transpose(1, 2)  # [B, Hkv, read_len, D]
        values = vc[read_slots, :read_len].transpose(1, 2)
        out = attention(q, keys, values, attn_mask=mask, enable_gqa=hkv != hq)  # never cuDNN: new shapes
        out = out.transpose(1, 2).reshape(bsz, seq, hq * d)
        return attn.o_proj(out)

    def _mlp(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layers[layer_idx].mlp
        gate_up_w = self._gate_up_weights[layer_idx]
        if gate_up_w is None:
            return mlp(x)
        gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_index: torch.Tensor,
        read_slots: slice | torch.Tensor,
        read_len: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Run every layer; RoPE rows, KV write indices and the additive mask are made once, not per layer.

        (SDPA turns a boolean mask into the same 0/−inf additive mask on every call otherwise.)
        """
        bsz, seq = positions.shape
        mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        rope = (self.cos_table[positions].unsqueeze(2), self.sin_signed_table[positions].unsqueeze(2))
        kv_index = (write_slots[:, None].expand(bsz, seq), write_index)
        for i, layer in enumerate(self.layers):
            h = rms_norm(layer.input_layernorm, x)
            x = x + self._attention(i, h, rope, kv_index, read_slots, read_len, mask)
            x = x + self._mlp(i, rms_norm(layer.post_attention_layernorm, x))
        return rms_norm(self.final_norm, x)

    # ------------------------------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, slot: int, rows: torch.Tensor) -> torch.Tensor:
        """Feed ``rows`` [L, H] to ``slot`` after its current context; returns fp32 logits of the last row."""
        start = self.cache.lengths[slot]
        length = int(rows.shape[0])
        end = start + length
        if end > self.context:
            raise ValueError(f"prefill of {length} rows at {start} exceeds the Talker context {self.context}")
        positions = torch.arange(start, end, device=self.device)[None, :]
        mask = (torch.arange(end, device=self.device)[None, :] <= positions[0][:, None])[
            None, None
        ]  # [1, 1, L, end]
        x = rows.to(device=self.device, dtype=self.dtype)[None]
        slots = torch.tensor([slot], device=self.device)
        hidden = self._layers(x, positions, slots, positions, slice(slot, slot + 1), end, mask)
        self.cache.lengths[slot] = end
        return self.model.head_logits(hidden[0, -1])

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Several slots' prefills in one forward; returns fp32 logits ``[len(items), V]`` of each last row.

        Streams that start together (c=8 requests arriving at once) would otherwise prefill one after the
        other, each a full eager pass over every layer. Rows are padded to the longest condition; a padded
        row writes to the scratch column and attends only to position 0, so it touches no slot's context.
        With prefill graphs on, a batch that fits a bucket replays a graph instead (:meth:`_prefill_graphed`).
        """
        bucket = self._prefill_bucket(items)
        if bucket is not None:
            return self._prefill_graphed(items, *bucket)
        if len(items) == 1:
            slot, rows = items[0]
            return self.prefill(slot, rows)[None]
        lengths = self.cache.lengths
        starts = [lengths[slot] for slot, _ in items]
        sizes = [int(rows.shape[0]) for _, rows in items]
        for start, size in zip(starts, sizes, strict=True):
            if start + size > self.context:
                raise ValueError(
                    f"prefill of {size} rows at {start} exceeds the Talker context {self.context}"
                )
        bsz, width = len(items), max(sizes)
        read_len = max(start + size for start, size in zip(starts, sizes, strict=True))
        dev = self.device
        x = torch.zeros(bsz, width, self.cfg.hidden_size, dtype=self.dtype, device=dev)
        for b, (_, rows) in enumerate(items):
            x[b, : sizes[b]] = rows.to(device=dev, dtype=self.dtype)
        t = torch.arange(width, device=dev)[None, :]
        start_t = torch.tensor(starts, device=dev)[:, None]
        valid = t < torch.tensor(sizes, device=dev)[:, None]  # [B, W]
        positions = torch.where(valid, start_t + t, torch.zeros_like(t))
        write_index = torch.where(valid, start_t + t, torch.full_like(t, self.cache.scratch_index))
        cols = torch.arange(read_len, device=dev)[None, None, :]
        mask = torch.where(valid[:, :, None], cols <= positions[:, :, None], cols == 0)[:, None]  # [B,1,W,R]
        slots = torch.tensor([slot for slot, _ in items], device=dev)
        hidden = self._layers(x, positions, slots, write_index, slots, read_len, mask)
        for (slot, _), start, size in zip(items, starts, sizes, strict=True):
            lengths[slot] = start + size
        last = hidden[torch.arange(bsz, device=dev), torch.tensor(sizes, device=dev) - 1]
        return self.model.head_logits(last)

    @torch.inference_mode()
    def warmup_prefill(self, streams: int | None = None, widths: tuple[int, ...] = (8, 16, 32, 64)) -> int:
        """Batched prefills of 1, 2, 4, … up to ``streams`` slots (default: all) at each row width in
        ``widths``, then every slot empty again; returns the rows fed.

        Why: the first burst of streams that start together (c=8 chat requests) prefills them in padded
        forwards (:meth:`prefill_batch`) whose batch and width depend on when each condition arrived; run
        first while serving, a new shape pays the caching allocator's new blocks and its GEMM kernels'
        first launch (their modules load lazily). The big first-burst cost on the H200 was elsewhere:
        cuDNN attention planned each new shape (:mod:`services.common.sdpa`). The thinker warms the
        same way (``burst_warmup_step``). Slots are free at start; the rows written here lie beyond every later
        stream's length, which masks them out until that stream overwrites them.
        """
        n = min(streams or self.cache.num_slots, self.cache.num_slots)
        if n < 1:
            return 0
        counts = sorted({min(1 << i, n) for i in range(n.bit_length() + 1)})
        saved = list(self.cache.lengths)
        fed = 0
        try:
            for count in counts:
                for width in widths:
                    x = torch.zeros(width, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
                    self.prefill_batch([(slot, x) for slot in range(count)])
                    self.cache.lengths[:] = saved
                    fed += count * width
        finally:
            self.cache.lengths[:] = saved
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return fed

    # ------------------------------------------------------------------------------ graphed prefill
    def enable_prefill_graphs(self, capture: Capture | None = None, max_batch: int = 8) -> None:
        """Route batched prefills of up to ``max_batch`` streams through shape-keyed graphs.

        ``capture`` is the CUDA capture into the decode graphs' pool by default, with the inputs and outputs
        in arenas outside it. Sharing the pool is safe because one thread replays every graph in turn and
        each replay's results are consumed before the next (a decode step's ids and logits inside
        :meth:`decode_sample`, a prefill's logits copied out by :meth:`_prefill_graphed`), so a graph may
        reuse another's intermediates. CPU tests pass a host-side emulation. Without CUDA and without
        ``capture`` nothing changes.
        """
        if capture is None:
            if self.device.type != "cuda":
                return
            capture = functools.partial(capture_cuda_graph, pool=self._graph_pool, shared=SharedBuffers())
        self.prefill_graph_batch = min(next_bucket(max_batch), next_bucket(self.cache.num_slots))
        self.prefill_graphs = ShapeKeyedGraphs("talker_prefill", self._prefill_fixed, capture=capture)

    def _prefill_bucket(self, items: list[tuple[int, torch.Tensor]]) -> tuple[int, int, int] | None:
        """(streams, rows, attention length) bucket of a graphed prefill, or None to prefill eagerly."""
        if self.prefill_graphs is None or not items or len(items) > self.prefill_graph_batch:
            return None
        longest = max(int(rows.shape[0]) for _, rows in items)
        width = next((w for w in PREFILL_WIDTHS if w >= longest), None)
        if width is None or longest == 0:
            return None
        lengths = self.cache.lengths
        end = max(lengths[slot] + int(rows.shape[0]) for slot, rows in items)
        if end > self.context:
            return None  # the eager path raises the context error
        batch, read_len = next_bucket(len(items)), min(next_bucket(end, MIN_LENGTH_BUCKET), self.context)
        if batch * read_len > PREFILL_GRAPH_KEYS:
            return None
        return batch, width, read_len

    def _prefill_fixed(
        self, x: torch.Tensor, ints: torch.Tensor, slots: torch.Tensor, cols: torch.Tensor
    ) -> tuple[torch.Tensor]:
        """The graphed prefill: fp32 logits ``[B, V]`` of each stream's last condition row.

        ``x`` [B, W, H] holds each stream's rows from column 0, zero-padded; ``ints`` [B, W, 3] =
        (position, KV write index, valid) per row; ``slots`` [B]; ``cols`` = ``arange(R)``, whose length is
        the attention length. A padding row (valid 0) writes to the scratch column and attends to column 0
        only, as in :meth:`prefill_batch`; padding streams have no valid row at all. Fixed shapes only.
        """
        positions, write_index, valid = ints.unbind(-1)
        live = valid.bool()
        mask = torch.where(live[:, :, None], cols <= positions[:, :, None], cols == 0)[:, None]
        hidden = self._layers(x, positions, slots, write_index, slots, cols.shape[0], mask)
        last = (valid.sum(dim=1) - 1).clamp_min(0)
        rows = torch.arange(x.shape[0], device=x.device)
        return (self.model.head_logits(hidden[rows, last]),)

    def _prefill_inputs(
        self, items: list[tuple[int, torch.Tensor]], batch: int, width: int, read_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded device inputs of :meth:`_prefill_fixed` for ``items`` in a (batch, width, read_len)
        bucket; streams past ``len(items)`` are padding (slot 0, every row invalid)."""
        dev = self.device
        x = torch.zeros(batch, width, self.cfg.hidden_size, dtype=self.dtype, device=dev)
        ints = torch.zeros(batch, width, 3, dtype=torch.int64)
        ints[:, :, 1] = self.cache.scratch_index
        slots = torch.zeros(batch, dtype=torch.int64)
        lengths = self.cache.lengths
        for b, (slot, rows) in enumerate(items):
            size, start = int(rows.shape[0]), lengths[slot]
            x[b, :size] = rows.to(device=dev, dtype=self.dtype)
            span = torch.arange(start, start + size)
            ints[b, :size, 0] = span
            ints[b, :size, 1] = span
            ints[b, :size, 2] = 1
            slots[b] = slot
        cols = self._cols.get(read_len)
        if cols is None:
            cols = self._cols[read_len] = torch.arange(read_len, device=dev)
        return x, to_device(ints, dev), to_device(slots, dev), cols

    def _prefill_graphed(
        self, items: list[tuple[int, torch.Tensor]], batch: int, width: int, read_len: int
    ) -> torch.Tensor:
        """:meth:`prefill_batch` through the graph of its bucket (eager if the frozen set lacks it)."""
        assert self.prefill_graphs is not None
        (logits,) = self.prefill_graphs(*self._prefill_inputs(items, batch, width, read_len))
        lengths = self.cache.lengths
        for slot, rows in items:
            lengths[slot] += int(rows.shape[0])
        return logits[: len(items)].clone()  # the output arena is the next replay's

    @torch.inference_mode()
    def warmup_prefill_graphs(self, max_batch: int | None = None) -> int:
        """Capture every prefill bucket (batch 1, 2, 4, … up to ``max_batch``, the engine's prefills per step;
        each row width; each attention length, up to ``PREFILL_GRAPH_KEYS`` key rows) and freeze the set, so no capture happens under traffic;
        returns the graphs held. A larger batch then prefills eagerly.

        The warm-up inputs are padding only (every row invalid): they write the scratch column and leave
        every slot's context and length as they were.
        """
        graphs = self.prefill_graphs
        if graphs is None:
            return 0
        if max_batch:
            self.prefill_graph_batch = next_bucket(min(max_batch, self.cache.num_slots))
        top = self.prefill_graph_batch
        # Largest first: the shared input and output arenas then reach their full size at the first
        # capture, instead of growing and leaving each smaller buffer held by the graphs captured on it.
        batches = [1 << i for i in reversed(range(top.bit_length()))]
        lengths = sorted({min(MIN_LENGTH_BUCKET << i, self.context) for i in range(16)}, reverse=True)
        for batch in batches:
            for width in reversed(PREFILL_WIDTHS):
                for read_len in lengths:
                    if batch * read_len <= PREFILL_GRAPH_KEYS:
                        graphs(*self._prefill_inputs([], batch, width, read_len))
        graphs.frozen = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return graphs.captured

    # -------------------------------------------------------------------------------------- decode
    def _step_eager(
        self, ints: torch.Tensor, floats: torch.Tensor, read_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode forward + sampling over slots ``0..n-1``; returns (fp32 logits [n, V], ids [n]).

        ``ints`` [n, 3 + sampler int columns] = (code, position, active, sampler knobs…), ``floats`` the
        sampler's fp32 knobs. Everything is a fixed-shape tensor op, so this exact function is what the
        CUDA graph captures and what CPU runs eagerly: tests on CPU exercise the graphed path's logic.
        """
        codes, positions, active = ints[:, 0], ints[:, 1], ints[:, 2].bool()
        n = codes.shape[0]
        x = self.model.emb_code[0](codes)
        write_index = torch.where(active, positions, torch.full_like(positions, self.cache.scratch_index))
        rope_pos = torch.where(active, positions, torch.zeros_like(positions))
        if self._fused is not None:
            hidden = self._fused.layers(x, rope_pos, write_index, read_len)
        else:
            cols = torch.arange(read_len, device=codes.device)
            mask = (cols[None, :] <= rope_pos[:, None])[:, None, None, :]
            slots = torch.arange(n, device=codes.device)
            hidden = self._layers(
                x[:, None], rope_pos[:, None], slots, write_index[:, None], slice(0, n), read_len, mask
            )[:, 0]
        logits = self.model.head_logits(hidden)
        ids = smp.sample_packed(logits, ints[:, 3:], floats, self.cfg.eos_id, self.vocab_salt)
        return logits, ids

    def _host_inputs(
        self, slots: list[int], codes: list[int], rows: list[tuple[list[int], list[float]]] | None
    ) -> tuple[int, int, list[list[int]], list[list[float]]]:
        """(batch bucket n, length bucket, int rows, float rows) for one step; advances nothing."""
        n = min(next_bucket(max(slots) + 1), self.cache.num_slots)
        int_rows = [[0, 0, 0, *self._idle_ints] for _ in range(n)]
        float_rows = [self._idle_floats] * n
        lengths = self.cache.lengths
        top = 0
        for k, s in enumerate(slots):
            pos = lengths[s]
            if pos >= self.context:
                raise ValueError(f"slot {s} is at the Talker context limit {self.context}")
            top = max(top, pos)
            if rows is None:
                int_rows[s] = [int(codes[k]), pos, 1, *self._idle_ints]
            else:
                int_rows[s] = [int(codes[k]), pos, 1, *rows[k][0]]
                float_rows[s] = rows[k][1]
        read_len = min(next_bucket(top + 1, MIN_LENGTH_BUCKET), self.context)
        return n, read_len, int_rows, float_rows

    def decode_sample(
        self,
        slots: list[int],
        codes: list[int],
        rows: list[tuple[list[int], list[float]]],
        want_logits: bool = False,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Feed one codec id to each of ``slots`` and draw each one's next id in the same step.

        ``rows`` are the sampler knobs per slot (:func:`sampling.pack_row`). Returns the picked ids (one
        device→host copy of ``n`` int64 per step) and, if asked, a copy of the fp32 logits [len(slots), V]
        (observers: dumps, tests; this adds a gather per step).
        """
        if not slots:
            return [], None
        n, read_len, int_rows, float_rows = self._host_inputs(slots, codes, rows)
        # inference mode: the graph's static buffers are inference tensors (in-place copies need it)
        with torch.inference_mode():
            ints = torch.tensor(int_rows, dtype=torch.int64)
            floats = torch.tensor(float_rows, dtype=torch.float32)
            graph = self._graph(n, read_len) if self.use_cuda_graphs else None
            if graph is not None:
                logits, ids = graph.run(ints, floats)
            else:
                logits, ids = self._step_eager(ints.to(self.device), floats.to(self.device), read_len)
            picked = ids.tolist()
            out_logits = None
            if want_logits:
                out_logits = logits.index_select(0, torch.tensor(slots, device=self.device))
        lengths = self.cache.lengths
        for s in slots:
            lengths[s] += 1
        return [picked[s] for s in slots], out_logits

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: list[int] | torch.Tensor) -> torch.Tensor:
        """Feed one codec id to each of ``slots`` (any subset); returns fp32 logits [len(slots), V].

        The step runs over the slot prefix ``0..n-1`` (n = a power-of-two bucket covering the highest slot)
        so shapes stay fixed per bucket; each slot's position is its cache length, which then advances.
        Same graphs as :meth:`decode_sample` (rows get neutral sampler knobs; their draws are ignored).
        """
        if not slots:
            return torch.empty(0, self.cfg.num_audio_tokens, device=self.device)
        code_list = codes.tolist() if isinstance(codes, torch.Tensor) else list(codes)
        idle = (self._idle_ints, self._idle_floats)
        _, logits = self.decode_sample(slots, code_list, [idle] * len(slots), want_logits=True)
        assert logits is not None
        return logits

    def _graph(self, n: int, read_len: int) -> _DecodeGraph | None:
        """The captured step for this bucket (captured on first use); None if capture failed.

        A failed capture turns graphs off for this runner (logged as an error, visible in GetInfo and
        the bench's ``cuda_graphs``) so the service keeps answering, eagerly, instead of failing.
        """
        key = (n, read_len)
        graph = self._graphs.get(key)
        if graph is None:
            log.info("capturing talker decode CUDA graph: batch %d, attention length %d", n, read_len)
            try:
                graph = _DecodeGraph.one_step(self, n, read_len, self._graph_pool)
            except Exception:
                log.exception("talker decode CUDA graph capture failed; decoding eagerly from now on")
                self.disable_graphs()
                return None
            self._graphs[key] = graph
        return graph

    def disable_graphs(self) -> None:
        """Decode eagerly from now on (a capture failed): drop every captured graph, one-step and block."""
        self.use_cuda_graphs = False
        self._graphs.clear()
        self.prefill_graphs = None
        if self.blocks is not None:
            self.blocks.clear()

    def warmup_graphs(self, max_batch: int | None = None, max_len: int | None = None) -> int:
        """Capture every (batch, length) bucket up to the limits ahead of traffic; returns the graph count.

        Server start and benchmarks call this so no request pays for a capture mid-stream.
        """
        if not self.use_cuda_graphs:
            return 0
        top_batch = min(max_batch or self.cache.num_slots, self.cache.num_slots)
        top_len = min(next_bucket(max_len or self.context, MIN_LENGTH_BUCKET), self.context)
        batches = sorted({min(next_bucket(b), self.cache.num_slots) for b in range(1, top_batch + 1)})
        lengths = []
        length = MIN_LENGTH_BUCKET
        while True:
            lengths.append(min(length, self.context))
            if length >= top_len:
                break
            length *= 2
        if self.blocks is not None:  # the engine decodes in blocks only: one-step graphs stay lazy
            return self.blocks.warmup(batches, lengths)
        with torch.inference_mode():
            for n in batches:
                for read_len in lengths:
                    if self._graph(n, read_len) is None:
                        return 0
        return len(self._graphs)


class _DecodeGraph:
    """One captured decode function for a fixed (batch, attention length[, steps]).

    ``step`` maps the static input buffers (int64 ``ints``, fp32 ``floats``, both on the device and
    initialised to all-idle rows whose K/V writes hit the scratch row) to (logits, picked ids); it is the
    one-step :meth:`TalkerRunner._step_eager` or the K-step block of :mod:`services.talker.multistep`.
    Host inputs are copied into the static buffers through pinned staging tensors; the picked ids
    come back through a pinned buffer with a single small device→host copy and one stream sync.
    """

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        ints: torch.Tensor,
        floats: torch.Tensor,
        pool: Any,
    ) -> None:
        self.ints = ints
        self.floats = floats
        self.ints_staging = torch.zeros(ints.shape, dtype=ints.dtype).pin_memory()
        self.floats_staging = torch.zeros(floats.shape, dtype=floats.dtype).pin_memory()
        self.done = torch.cuda.Event()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                step(self.ints, self.floats)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with (
            torch.inference_mode(),
            torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"),
        ):
            self.logits, self.ids = step(self.ints, self.floats)
        self.ids_host = torch.zeros(self.ids.shape, dtype=self.ids.dtype).pin_memory()

    @classmethod
    def one_step(cls, runner: TalkerRunner, n: int, read_len: int, pool: Any) -> _DecodeGraph:
        """The one-step decode+sample graph of :meth:`TalkerRunner.decode_sample`."""
        dev = runner.device
        ints = torch.zeros(n, 3 + smp.INT_COLUMNS, dtype=torch.int64, device=dev)  # inactive rows
        ints[:, 3:] = torch.tensor(runner._idle_ints, dtype=torch.int64, device=dev)
        floats = torch.ones(n, smp.FLOAT_COLUMNS, dtype=torch.float32, device=dev)
        return cls(lambda i, f: runner._step_eager(i, f, read_len), ints, floats, pool)

    def run(self, ints: torch.Tensor, floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay with these inputs; returns (static logits, ids on the host)."""
        self.ints_staging.copy_(ints)
        self.floats_staging.copy_(floats)
        self.ints.copy_(self.ints_staging, non_blocking=True)
        self.floats.copy_(self.floats_staging, non_blocking=True)
        self.graph.replay()
        self.ids_host.copy_(self.ids, non_blocking=True)
        self.done.record()
        self.done.synchronize()
        return self.logits, self.ids_host
