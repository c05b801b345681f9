"""Paged KV cache of the thinker LLM, accounted in bytes.

The cache is one pool of fixed-size blocks shared by every stream. Each layer owns two flat tensors
``[num_slots, kv_heads, head_dim]`` (K and V) where ``slot = block * block_size + offset``; a sequence
owns a list of blocks (its block table). Writing new keys is an ``index_copy_`` at the slots of the new
positions and reading a sequence back is a gather over its slots, so sequences of different lengths
batch together without padding the cache itself.

Why a pool sized from a byte budget: admission control needs a hard ceiling that holds by
construction. The pool holds ``budget // bytes_per_block`` blocks, one of which is a scratch block
(padded rows of a CUDA-graph batch write there), so the allocated bytes reported by the gauge can
never exceed the budget, whatever the scheduler does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of the cache; everything that sizes memory derives from here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-max(0, num_tokens) // self.block_size)


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request (never partial)."""


class BlockPool:
    """Free-list allocator of block ids; block 0 is reserved as scratch and never handed out."""

    SCRATCH_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (1 scratch + 1 usable), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end so low ids are handed out first (easier to read in debugging).
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever hold (all but scratch)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        return out

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Per-layer K/V storage plus the block pool that accounts it."""

    def __init__(self, layout: KVLayout, budget_bytes: int, device: torch.device | str) -> None:
        num_blocks = budget_bytes // layout.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV budget {budget_bytes} B holds {num_blocks} blocks of {layout.bytes_per_block} B; need >= 2"
            )
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks)
        num_slots = num_blocks * layout.block_size
        shape = (num_slots, layout.num_kv_heads, layout.head_dim)
        # Uninitialised storage (pages are touched only when used); only the scratch block must hold
        # finite values, because padded rows attend to it and NaN * 0 would still be NaN.
        self.k: list[torch.Tensor] = [
            torch.empty(shape, dtype=layout.dtype, device=self.device) for _ in range(layout.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.empty(shape, dtype=layout.dtype, device=self.device) for _ in range(layout.num_layers)
        ]
        scratch = slice(
            BlockPool.SCRATCH_BLOCK * layout.block_size, (BlockPool.SCRATCH_BLOCK + 1) * layout.block_size
        )
        for t in (*self.k, *self.v):
            t[scratch].zero_()

    @property
    def used_bytes(self) -> int:
        return self.pool.used_blocks * self.layout.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity * self.layout.block_size

    def slots_for(self, blocks: list[int], start: int, end: int) -> list[int]:
        """Flat slot ids of positions ``[start, end)`` of a sequence that owns ``blocks``."""
        bs = self.layout.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


def default_kv_budget(
    layout: KVLayout, device: torch.device, max_context: int, max_num_seqs: int, gpu_fraction: float = 0.9
) -> int:
    """Budget when the operator gives none: most of free GPU memory, or enough for a few streams on CPU.

    On CUDA the weights are already resident when this runs, so ``mem_get_info`` reflects what is left.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Keep headroom for activations, logits of a full prefill chunk and CUDA-graph pools.
        return int(max(0, free - 2 * 1024**3) * gpu_fraction)
    want = layout.bytes_per_token * max_context * max_num_seqs
    return int(min(want, 2 * 1024**3))
