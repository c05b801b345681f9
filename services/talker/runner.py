"""Forward passes of the Talker backbone over the static slot cache: one-stream prefill, batched decode.

The backbone weights are transformers' ``LlamaModel`` modules (q/k/v/o projections, RMSNorms, MLP), so
the arithmetic is the library's; what this module adds is the cache discipline (:mod:`kv_cache`) that
lets many streams at different positions decode in one batched step:

* ``prefill(slot, rows)`` runs one stream's condition (any length) starting at its current cache length,
  writes K/V at those positions, and returns the logits of the last row;
* ``decode(codes, positions, active, n)`` feeds one codec id for each of the slots ``0..n-1`` at once;
  each row writes its K/V at its own position and attends to its own prefix only (a per-row mask).
  Rows that sit out the step write to the cache's scratch column and their outputs are ignored.

On CUDA the decode step is captured once per (batch bucket, attention-length bucket) into a CUDA graph
and replayed; on CPU (tests) the same function runs eagerly. Buckets are powers of two so a handful of
graphs cover every batch size and context length.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from services.talker.kv_cache import SlotKVCache
from services.talker.model.tts import MiniCPMTTS

log = logging.getLogger(__name__)

MIN_LENGTH_BUCKET = 64


def next_bucket(value: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ max(value, minimum)."""
    b = max(1, minimum)
    while b < value:
        b *= 2
    return b


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TalkerRunner:
    """Owns the model, the slot cache, the RoPE tables and (on CUDA) the decode graphs."""

    def __init__(
        self,
        model: MiniCPMTTS,
        *,
        num_slots: int,
        use_cuda_graphs: bool | None = None,
    ) -> None:
        self.model = model
        cfg = model.cfg
        self.cfg = cfg
        self.device = model.device
        self.dtype = model.dtype
        self.context = cfg.max_position_embeddings
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.layers = list(model.model.layers)
        self.final_norm = model.model.norm
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
        self.sin_table = (emb.sin() * scaling).to(self.dtype)
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.use_cuda_graphs = bool(use_cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None

    # ----------------------------------------------------------------------------------- attention
    def _attention(
        self,
        layer_idx: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_index: torch.Tensor,
        read_slots: slice,
        read_len: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, T, H]; K/V of each (row, t) go to cache[layer, write_slots[row], :, write_index[row, t]]."""
        attn = self.layers[layer_idx].self_attn
        bsz, seq, _ = x.shape
        q = attn.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos = self.cos_table[positions].unsqueeze(1)  # [B, 1, T, D]
        sin = self.sin_table[positions].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        # index_put over (slot, head, position): [B, T] slot/position grids broadcast against heads.
        slot_grid = write_slots[:, None, None].expand(bsz, self.num_kv_heads, seq)
        head_grid = torch.arange(self.num_kv_heads, device=x.device)[None, :, None].expand(bsz, -1, seq)
        pos_grid = write_index[:, None, :].expand(bsz, self.num_kv_heads, seq)
        kc.index_put_((slot_grid, head_grid, pos_grid), k)
        vc.index_put_((slot_grid, head_grid, pos_grid), v)
        keys = kc[read_slots, :, :read_len]
        values = vc[read_slots, :, :read_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )
        out = out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim)
        return attn.o_proj(out)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_index: torch.Tensor,
        read_slots: slice,
        read_len: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(i, h, positions, write_slots, write_index, read_slots, read_len, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.final_norm(x)

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

    # -------------------------------------------------------------------------------------- decode
    def _decode_eager(
        self, codes: torch.Tensor, positions: torch.Tensor, active: torch.Tensor, read_len: int
    ) -> torch.Tensor:
        n = codes.shape[0]
        x = self.model.emb_code[0](codes)[:, None, :]
        write_index = torch.where(active, positions, torch.full_like(positions, self.cache.scratch_index))
        rope_pos = torch.where(active, positions, torch.zeros_like(positions))
        limit = torch.where(active, positions, torch.zeros_like(positions))
        mask = (torch.arange(read_len, device=codes.device)[None, :] <= limit[:, None])[:, None, None, :]
        slots = torch.arange(n, device=codes.device)
        hidden = self._layers(x, rope_pos[:, None], slots, write_index[:, None], slice(0, n), read_len, mask)
        return self.model.head_logits(hidden[:, 0])

    @torch.inference_mode()
    def decode(self, slots: list[int], codes: list[int] | torch.Tensor) -> torch.Tensor:
        """Feed one codec id to each of ``slots`` (any subset); returns fp32 logits [len(slots), V].

        The step runs over the slot prefix ``0..n-1`` (n = a power-of-two bucket covering the highest slot)
        so shapes stay fixed per bucket; each slot's position is its cache length, which then advances.
        """
        if not slots:
            return torch.empty(0, self.cfg.num_audio_tokens, device=self.device)
        n = min(next_bucket(max(slots) + 1), self.cache.num_slots)
        positions = [0] * n
        active = [False] * n
        code_row = [0] * n
        code_list = codes.tolist() if isinstance(codes, torch.Tensor) else list(codes)
        for s, c in zip(slots, code_list, strict=True):
            pos = self.cache.lengths[s]
            if pos >= self.context:
                raise ValueError(f"slot {s} is at the Talker context limit {self.context}")
            positions[s] = pos
            active[s] = True
            code_row[s] = int(c)
        read_len = min(next_bucket(max(positions[s] for s in slots) + 1, MIN_LENGTH_BUCKET), self.context)
        codes_t = torch.tensor(code_row, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        active_t = torch.tensor(active, dtype=torch.bool)
        if self.use_cuda_graphs:
            logits = self._graph(n, read_len).run(codes_t, pos_t, active_t)
        else:
            logits = self._decode_eager(
                codes_t.to(self.device), pos_t.to(self.device), active_t.to(self.device), read_len
            )
        for s in slots:
            self.cache.lengths[s] += 1
        index = torch.tensor(slots, device=self.device)
        return logits.index_select(0, index)

    def _graph(self, n: int, read_len: int) -> _DecodeGraph:
        key = (n, read_len)
        graph = self._graphs.get(key)
        if graph is None:
            log.info("capturing talker decode CUDA graph: batch %d, attention length %d", n, read_len)
            graph = _DecodeGraph(self, n, read_len, self._graph_pool)
            self._graphs[key] = graph
        return graph

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
        with torch.inference_mode():
            for n in batches:
                for read_len in lengths:
                    self._graph(n, read_len)
        return len(self._graphs)


class _DecodeGraph:
    """One captured decode step for a fixed (batch, attention length); inputs are copied into static buffers."""

    def __init__(self, runner: TalkerRunner, n: int, read_len: int, pool: object) -> None:
        dev = runner.device
        self.codes = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)  # all inactive: warm-up writes hit scratch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                runner._decode_eager(self.codes, self.positions, self.active, read_len)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.logits = runner._decode_eager(self.codes, self.positions, self.active, read_len)

    def run(self, codes: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        self.codes.copy_(codes, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.active.copy_(active, non_blocking=True)
        self.graph.replay()
        return self.logits
