"""``AttentionTiles``, the launch geometry shared by the ops backends (its own module so that the Triton
backend, which the package imports lazily, can import it without importing the package back: no cycle)."""

from __future__ import annotations

import torch


class AttentionTiles:
    """Where each query tile of a step lives: packed rows, sequence (block-table row) and positions.

    A tile is up to ``block_t`` consecutive rows of one sequence whose positions are ``pos, pos+1, ...``;
    it attends to keys ``[0, pos + t]`` for its row ``t``. Decode rows are tiles of one row. ``table`` is
    ``[sequences, max_blocks]`` (int64 block ids, padded with the scratch block); ``splits`` splits each
    tile's keys over that many programs (flash-decoding) when tiles are too few to fill the GPU.
    """

    __slots__ = ("row", "length", "seq", "pos", "table", "page_size", "block_t", "splits")

    def __init__(
        self,
        row: torch.Tensor,
        length: torch.Tensor,
        seq: torch.Tensor,
        pos: torch.Tensor,
        table: torch.Tensor,
        page_size: int,
        block_t: int,
        splits: int = 1,
    ) -> None:
        self.row, self.length, self.seq, self.pos = row, length, seq, pos
        self.table = table
        self.page_size = int(page_size)
        self.block_t = int(block_t)
        self.splits = max(1, int(splits))
