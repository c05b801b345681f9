"""The CUDA graph of a packed row step (decode rows and short prefill chunks), one per shape bucket."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from services.thinker.kv_cache import BlockPool

if TYPE_CHECKING:
    from services.thinker.runner import ModelRunner

SCRATCH_SLOT = BlockPool.SCRATCH_BLOCK  # slot 0 lives in the scratch block

Outputs = tuple[torch.Tensor, torch.Tensor]
# (runner, body) -> (replay, outputs the replay refreshes); tests substitute a host-side emulation.
Capture = Callable[["ModelRunner", Callable[[], Outputs]], tuple[Callable[[], None], Outputs]]


def capture_cuda_graph(runner: ModelRunner, body: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
    """Warm ``body`` up on a side stream, then record it into the runner's shared graph pool."""
    dev = runner.device
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (allocator, kernels' lazy init)
            body()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if runner._graph_pool is None:
        runner._graph_pool = torch.cuda.graph_pool_handle()
    # thread_local: the encoder worker threads may use the GPU while the engine thread captures.
    with torch.cuda.graph(graph, pool=runner._graph_pool, capture_error_mode="thread_local"):
        outputs = body()
    return graph.replay, outputs


class RowGraph:
    """A captured row step for one (rows, context) bucket with its static input/output buffers.

    Rows are decode tokens or the tokens of short prefill chunks (see ``ModelRunner.pack_rows``); rows
    that carry audio/vision embeddings take them from ``embeds`` where ``use_embeds`` is set. Padded rows
    write to and read from the scratch block only.
    """

    def __init__(self, runner: ModelRunner, batch: int, context: int) -> None:
        self.batch = batch
        self.context = context
        self.blocks = -(-context // runner.cache.layout.block_size)
        dev = runner.device
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self.write = torch.full((batch,), SCRATCH_SLOT, dtype=torch.long, device=dev)
        self.table = torch.full((batch, self.blocks), BlockPool.SCRATCH_BLOCK, dtype=torch.long, device=dev)
        self.embeds = torch.zeros(batch, runner.hidden_size, dtype=runner.dtype, device=dev)
        self.use_embeds = torch.zeros(batch, dtype=torch.bool, device=dev)
        self._embeds_dirty = False
        args = (self.ids, self.pos, self.write, self.table, self.embeds, self.use_embeds)
        capture = runner.graph_capture or capture_cuda_graph
        self._replay, (self.hidden, self.logits) = capture(runner, lambda: runner.decode_forward_static(*args))

    def run(
        self, host: tuple[torch.Tensor, ...], embeds: Sequence[tuple[int, torch.Tensor]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, write, table = host
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos, non_blocking=True)
        self.write.copy_(write, non_blocking=True)
        self.table.copy_(table, non_blocking=True)
        if self._embeds_dirty:
            self.use_embeds.zero_()
            self._embeds_dirty = False
        for row, e in embeds:
            self.embeds[row : row + e.shape[0]].copy_(e, non_blocking=True)
            self.use_embeds[row : row + e.shape[0]] = True
            self._embeds_dirty = True
        self._replay()
        return self.hidden, self.logits
