"""A static, preallocated per-slot KV cache for the Talker.

Why static: every stream's context is bounded by the Talker's 4096 positions (rollover handles longer
duplex turns), so one ``[layers, slots, context + 1, kv_heads, head_dim]`` tensor pair holds every stream
without reallocation, decode reads it through plain views (no gather copies), and the batched decode
step has fixed shapes per (batch bucket, length bucket), which is what CUDA-graph capture needs.

Layout rules the runner relies on:

* a stream owns one slot from admission to close; slots are handed out lowest-first so the active
  slots form a short prefix and the decode batch ``slots[0:n]`` stays small;
* in every mode, position == cache index (upstream positions always start at 0 with an empty cache and
  advance by one per fed row), so a slot's ``length`` is both its next write index and next position;
* token-major rows (position, then head) as in the thinker's paged cache, so the fused decode path
  (:mod:`services.talker.fused_decode`) reads a slot as one page of ``context + 1`` rows;
* the extra last row (index ``context``) is a scratch row: decode rows that do not take part in a
  step write there, and no attention mask ever includes it.
"""

from __future__ import annotations

import math

import torch


class SlotKVCache:
    """K and V for ``num_slots`` streams of up to ``context`` positions each."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        context: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.context = context
        self.scratch_index = context
        shape = (num_layers, num_slots, context + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots))

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """Lowest free slot, or None when full (the engine then queues the stream)."""
        if not self._free:
            return None
        self._free.sort()
        slot = self._free.pop(0)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            return
        self.lengths[slot] = 0
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Forget a slot's context (new turn, recompute window); the stale values are masked out."""
        self.lengths[slot] = 0

    def highest_active(self) -> int:
        used = [s for s in range(self.num_slots) if s not in self._free]
        return max(used) if used else -1


# Memory the talker keeps beside its weights and slots: the decode graphs' pools, prefill activations,
# sampling buffers. On an H100 the talker's measured peak (5.47 GiB at 16 streams, 7.38 at 24; BENCHMARKS.md)
# less its slots and its weights (~0.6 GiB, counted from the shapes) leaves 1.12 and 1.15 GiB.
SLOT_HEADROOM_BYTES = 1280 * 1024**2


class SlotBudgetError(ValueError):
    """The talker's memory cap cannot hold the KV slots its stream limit asks for (a startup error)."""


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of one stream's slot in :class:`SlotKVCache` (K and V, ``context`` positions plus scratch)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * (context + 1) * num_kv_heads * head_dim * elem


def check_slot_budget(
    num_slots: int,
    per_slot_bytes: int,
    fraction: float,
    total_bytes: int,
    held_bytes: int,
    key: str = "stages.talker.memory_fraction",
    headroom_bytes: int = SLOT_HEADROOM_BYTES,
) -> None:
    """Refuse at start, with the numbers and the settings to change, a stream limit whose slots do not fit
    the per-process cap: ``fraction × total − held − headroom`` must hold ``num_slots`` slots. Without this
    the talker died with a bare ``OutOfMemoryError`` in the middle of building its runner."""
    cap = int(fraction * total_bytes)
    room = cap - int(held_bytes) - int(headroom_bytes)
    need = num_slots * per_slot_bytes
    if need <= room:
        return
    fits = max(0, room // per_slot_bytes)
    at_least = math.ceil(1000 * (int(held_bytes) + int(headroom_bytes) + need) / total_bytes) / 1000
    raise SlotBudgetError(
        f"{num_slots} streams need {_gib(need)} of KV ({_gib(per_slot_bytes)} each), but the cap ({key} "
        f"{fraction:g} of {_gib(total_bytes)} = {_gib(cap)}) holds {_gib(held_bytes)} already and keeps "
        f"{_gib(headroom_bytes)} for graphs and activations, which leaves room for {fits}. Raise {key} to "
        f"at least {at_least:.3f}, or lower the talker's max_num_seqs (--max-streams) to {fits}."
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
