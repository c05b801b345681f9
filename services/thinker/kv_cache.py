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

import math
from collections import OrderedDict
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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-max(0, num_tokens) // self.block_size)


KV_CACHE_FORMATS = ("bf16", "fp8")


def kv_cache_dtype(kv_cache: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for the profile's ``kv_cache``: ``bf16`` keeps the model's dtype; ``fp8``
    stores e4m3 with no scale. Qwen3's keys are RMS-normed per head before rotary and its values are
    projections of a normed row, so both are expected well inside e4m3's ±448 (not checked on trained
    weights, which are unavailable here; beyond it a value saturates); what fp8 costs is the 3-bit
    mantissa, measured on the random checkpoints in docs/fidelity.md. Attention widens every loaded key and
    value back to the model's dtype (exact) and computes as before."""
    if kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_FORMATS)} (got {kv_cache!r})")
    return torch.float8_e4m3fn if kv_cache == "fp8" else model_dtype


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request (never partial)."""


class BlockPool:
    """Reference-counted allocator of block ids with an optional prefix index; block 0 is scratch.

    A block is in one of three states: *free* (no content of value), *in use* (held by one or more
    sequences: ``refcount > 0``) or *cached* (refcount 0 but its content is registered under a prefix
    hash, kept in LRU order and reclaimed only when the free list runs dry). Only full blocks are ever
    registered (:meth:`register`), and a full block is never written again, so any number of sequences
    can read one block through their block tables without copies. ``prefix_caching=False`` makes
    :meth:`register` a no-op, which turns the pool back into a plain free list.
    """

    SCRATCH_BLOCK = 0

    def __init__(self, num_blocks: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (1 scratch + 1 usable), got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        # Pop from the end so low ids are handed out first (easier to read in debugging).
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._refs: list[int] = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        # Cached blocks nobody holds, least recently released first (the eviction order).
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0  # cached blocks reclaimed for new content (a counter the engine exports)

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever hold (all but scratch)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus cached blocks nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.capacity - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks registered in the prefix index (held or not)."""
        return len(self._by_hash)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1): the free list first, then the least recently used cached ones."""
        if n > self.free_blocks:
            raise OutOfBlocks(f"need {n} KV blocks, {self.free_blocks} free")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Unheld registered blocks stay cached; the rest are freed.

        Released last block first, so the deep end of a prefix chain is the first evicted (evicting its
        head would strand every block after it).
        """
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"KV block {block} released more often than it was taken")
            self._refs[block] = refs
            if refs:
                continue
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    # ---------------------------------------------------------------------------------- prefix index
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest run of ``hashes`` (a chain from position 0) that the index holds."""
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def unheld(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached and held by nobody (taking them shrinks :attr:`free_blocks`)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """Take one reference to each (cached or in-use) block found by :meth:`lookup`."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1

    def register(self, block: int, h: bytes) -> bool:
        """File a full, held block under its prefix hash; False when off or the hash is filed already.

        A second block with the same content (two sequences computed one prefix at once) stays private
        and goes back to the free list when released.
        """
        if not self.prefix_caching or h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        return True


class PagedKVCache:
    """Per-layer K/V storage plus the block pool that accounts it."""

    def __init__(
        self, layout: KVLayout, budget_bytes: int, device: torch.device | str, *, prefix_caching: bool = False
    ) -> None:
        num_blocks = budget_bytes // layout.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV budget {budget_bytes} B holds {num_blocks} blocks of {layout.bytes_per_block} B; need >= 2"
            )
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks, prefix_caching=prefix_caching)
        num_slots = num_blocks * layout.block_size
        shape = (num_slots, layout.num_kv_heads, layout.head_dim)
        # Uninitialised storage (pages are touched only when used); only the scratch block must hold
        # finite values, because padded rows attend to it and NaN * 0 would still be NaN.
        try:
            self.k: list[torch.Tensor] = [
                torch.empty(shape, dtype=layout.dtype, device=self.device) for _ in range(layout.num_layers)
            ]
            self.v: list[torch.Tensor] = [
                torch.empty(shape, dtype=layout.dtype, device=self.device) for _ in range(layout.num_layers)
            ]
        except torch.OutOfMemoryError as exc:  # a last line behind check_kv_budget: a startup error, typed
            raise KVBudgetError(
                f"the KV cache of {_gib(budget_bytes)} does not fit in the device memory this process may use "
                f"({str(exc).splitlines()[0]}); give --kv-budget auto or a smaller budget"
            ) from None
        scratch = slice(
            BlockPool.SCRATCH_BLOCK * layout.block_size, (BlockPool.SCRATCH_BLOCK + 1) * layout.block_size
        )
        for t in (*self.k, *self.v):
            t[scratch].view(torch.uint8).zero_()  # through the bytes: any element type, fp8 included

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


# Bytes kept out of the KV pool for what else the thinker allocates after it: activations and logits of
# a full prefill chunk, sampling buffers and the CUDA-graph memory pools of the decode batch shapes.
KV_HEADROOM_BYTES = 2 * 1024**3
# More bytes kept out of the KV pool per sequence the thinker may run (with its duplex Whisper cache, see
# services/thinker/backend.py): what a session holds on the device beyond that cache (its unit and voice
# rows, context record, policy state) and the share of transient activations and allocator
# fragmentation that grows with the number of sessions. 24 duplex sessions at once on an H100 ran out of
# memory within 3 s with the fixed 2 GiB alone: 1.42 GiB allocated beyond the weights, the KV pool and the
# Whisper caches, plus 0.87 GiB held by the allocator unallocated (BENCHMARKS.md).
SEQUENCE_HEADROOM_BYTES = 48 * 1024**2
# Without a memory fraction the pool takes this share of the memory left free after the headroom.
FREE_MEMORY_SHARE = 0.9


class KVBudgetError(ValueError):
    """The thinker's memory cap leaves no room for a KV cache (a startup error, never raised mid-serving)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_budget_for_memory_fraction(
    fraction: float,
    total_bytes: int,
    held_bytes: int,
    headroom_bytes: int = KV_HEADROOM_BYTES,
    min_bytes: int = 1,
    key: str = "stages.thinker.memory_fraction",
) -> int:
    """KV bytes inside a per-process memory cap: ``fraction × total − held − headroom``.

    ``held_bytes`` is what this process's allocator already holds when the pool is sized (the weights,
    i.e. ``torch.cuda.memory_reserved``); the headroom covers what is allocated after the pool. The cap
    is what ``torch.cuda.set_per_process_memory_fraction`` enforces, so a larger pool would make the
    first prefill or CUDA-graph capture fail instead. ``min_bytes`` is the least usable pool (two blocks);
    ``key`` names the setting to change in the error.
    """
    cap = int(fraction * total_bytes)
    budget = kv_budget_room(fraction, total_bytes, held_bytes, headroom_bytes)
    if budget < min_bytes:
        # rounded up, so the suggested value is really enough
        needed = math.ceil(1000 * (int(held_bytes) + int(headroom_bytes) + min_bytes) / total_bytes) / 1000
        raise KVBudgetError(
            f"{key} = {fraction:g} caps the thinker at {_gib(cap)} of {_gib(total_bytes)}, which leaves no room "
            f"for the KV cache: the weights already hold {_gib(held_bytes)} and {_gib(headroom_bytes)} is kept "
            f"for activations, CUDA-graph pools and duplex audio caches. Raise {key} to at least {needed:.3f}, or give --kv-budget."
        )
    return budget


def kv_budget_room(
    fraction: float, total_bytes: int, held_bytes: int, headroom_bytes: int = KV_HEADROOM_BYTES
) -> int:
    """Bytes a KV pool may take inside a per-process cap: ``fraction × total − held − headroom``."""
    return int(fraction * total_bytes) - int(held_bytes) - int(headroom_bytes)


def check_kv_budget(
    budget_bytes: int,
    *,
    total_bytes: int,
    held_bytes: int,
    fraction: float | None = None,
    free_bytes: int | None = None,
    headroom_bytes: int = KV_HEADROOM_BYTES,
    key: str = "stages.thinker.memory_fraction",
) -> None:
    """An explicit ``--kv-budget`` must fit what the stage may hold, or the pool's allocation (or the first
    prefill after it) dies with an out-of-memory error instead of a clear startup message.

    With a memory ``fraction`` the room is the cap minus what the process holds (the weights) minus the
    headroom; without one it is the device's free memory minus the headroom.
    """
    if fraction is not None:
        room = kv_budget_room(fraction, total_bytes, held_bytes, headroom_bytes)
        if budget_bytes <= room:
            return
        needed = math.ceil(1000 * (int(held_bytes) + int(headroom_bytes) + budget_bytes) / total_bytes) / 1000
        cap = int(fraction * total_bytes)
        raise KVBudgetError(
            f"--kv-budget {_gib(budget_bytes)} does not fit the thinker's memory cap: {key} = {fraction:g} of "
            f"{_gib(total_bytes)} is {_gib(cap)}, the weights already hold {_gib(held_bytes)} and "
            f"{_gib(headroom_bytes)} is kept for activations, CUDA-graph pools and duplex audio caches, which "
            f"leaves {_gib(max(0, room))} for the KV cache. Give --kv-budget auto (sized from the cap) or at "
            f"most {_gib(max(0, room))}, or raise {key} to at least {needed:.3f}."
        )
    if free_bytes is not None and budget_bytes > free_bytes - headroom_bytes:
        raise KVBudgetError(
            f"--kv-budget {_gib(budget_bytes)} does not fit the free device memory: {_gib(free_bytes)} of "
            f"{_gib(total_bytes)} is free and {_gib(headroom_bytes)} is kept for activations and CUDA-graph "
            f"pools, which leaves {_gib(max(0, free_bytes - headroom_bytes))}. Give --kv-budget auto or a "
            "smaller budget."
        )


def check_explicit_kv_budget(
    budget_bytes: int,
    device: torch.device,
    memory_fraction: float | None = None,
    memory_fraction_key: str = "stages.thinker.memory_fraction",
    reserve_bytes: int = 0,
) -> None:
    """:func:`check_kv_budget` with the device's numbers (CUDA only; a CPU budget is the operator's call)."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    held = max(torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
    free = None if memory_fraction is not None else torch.cuda.mem_get_info(device)[0]
    check_kv_budget(
        budget_bytes,
        total_bytes=total,
        held_bytes=held,
        fraction=memory_fraction,
        free_bytes=free,
        headroom_bytes=KV_HEADROOM_BYTES + reserve_bytes,
        key=memory_fraction_key,
    )


def default_kv_budget(
    layout: KVLayout,
    device: torch.device,
    max_context: int,
    max_num_seqs: int,
    gpu_fraction: float = FREE_MEMORY_SHARE,
    memory_fraction: float | None = None,
    memory_fraction_key: str = "stages.thinker.memory_fraction",
    reserve_bytes: int = 0,
) -> int:
    """Budget when the operator gives no ``--kv-budget``.

    ``reserve_bytes`` stays free for state allocated after the pool outside it (duplex Whisper caches).

    On CUDA the weights are already resident when this runs. With a per-process ``memory_fraction`` the
    pool fills the cap (:func:`kv_budget_for_memory_fraction`); without one it takes ``gpu_fraction`` of
    the memory ``mem_get_info`` reports free beyond the headroom, which is only safe when the thinker
    has the GPU to itself or starts last. On CPU: enough for a few full-length streams, at most 2 GiB.
    """
    if device.type == "cuda":
        if memory_fraction is not None:
            # Return blocks cached from loading (e.g. dtype-conversion temporaries) first: they count
            # against the cap but a pool this large could not reuse them.
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            held = max(torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
            return kv_budget_for_memory_fraction(
                memory_fraction,
                total,
                held,
                headroom_bytes=KV_HEADROOM_BYTES + reserve_bytes,
                min_bytes=2 * layout.bytes_per_block,
                key=memory_fraction_key,
            )
        free, _total = torch.cuda.mem_get_info(device)
        return int(max(0, free - KV_HEADROOM_BYTES - reserve_bytes) * gpu_fraction)
    want = layout.bytes_per_token * max_context * max_num_seqs
    return int(min(want, 2 * 1024**3))
