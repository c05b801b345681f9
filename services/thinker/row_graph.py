"""The CUDA graph of a packed row step (decode rows and prefill chunks), one per shape bucket."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from services.thinker.kv_cache import BlockPool, PagedKVCache

if TYPE_CHECKING:
    from services.thinker.step_types import DecodeRow

SCRATCH_SLOT = BlockPool.SCRATCH_BLOCK  # slot 0 lives in the scratch block

Outputs = tuple[torch.Tensor, torch.Tensor]


class GraphHost(Protocol):
    """What a row graph uses of its model runner (``ModelRunner``): a protocol, so this module, which the
    runner imports, need not import the runner back."""

    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    cache: PagedKVCache
    graph_capture: Capture | None
    _graph_pool: Any  # the runner's shared CUDA graph memory pool, made by the first capture

    def row_logits_buffer(self, batch: int, like: torch.Tensor) -> torch.Tensor: ...

    def decode_forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write: torch.Tensor,
        table: torch.Tensor,
        embeds: torch.Tensor | None = None,
        use_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# (runner, body) -> (replay, outputs the replay refreshes); tests substitute a host-side emulation.
Capture = Callable[["GraphHost", Callable[[], Outputs]], tuple[Callable[[], None], Outputs]]


def fill_rows(rows: Sequence[DecodeRow], block_size: int, host: np.ndarray, batch: int, blocks: int) -> None:
    """Write the rows' ids, positions, write slots and block tables into one int64 host array.

    Layout ``[ids B | positions B | write slots B | table B*blocks]``; padded rows keep position 0 and
    the scratch block, so they write to and read from scratch only.
    """
    host[: 2 * batch] = 0
    host[2 * batch : 3 * batch] = SCRATCH_SLOT
    table = host[3 * batch :].reshape(batch, blocks)
    table[:] = BlockPool.SCRATCH_BLOCK
    for i, r in enumerate(rows):
        used = r.position // block_size + 1
        host[i] = r.token_id
        host[batch + i] = r.position
        host[2 * batch + i] = r.blocks[used - 1] * block_size + r.position % block_size
        table[i, :used] = r.blocks[:used]


def capture_cuda_graph(runner: GraphHost, body: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
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

    Rows are decode tokens or the tokens of prefill chunks (see ``ModelRunner.pack_rows``); rows
    that carry audio/vision embeddings take them from ``embeds`` where ``use_embeds`` is set. Padded rows
    write to and read from the scratch block only.
    """

    def __init__(self, runner: GraphHost, batch: int, context: int) -> None:
        self.batch = batch
        self.context = context
        self.blocks = -(-context // runner.cache.layout.block_size)
        dev = runner.device
        self.block_size = runner.cache.layout.block_size
        # One device buffer for every small input (one H2D copy per step) and its host mirror, pinned on
        # CUDA so the copy is asynchronous; the event guards the mirror against a copy still in flight.
        n = batch * (3 + self.blocks)
        self.staging = torch.zeros(n, dtype=torch.long, device=dev)
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        fill_rows([], self.block_size, self._host_np, batch, self.blocks)
        self.staging.copy_(self._host)
        self.ids = self.staging[:batch]
        self.pos = self.staging[batch : 2 * batch]
        self.write = self.staging[2 * batch : 3 * batch]
        self.table = self.staging[3 * batch :].view(batch, self.blocks)
        self.embeds = torch.zeros(batch, runner.hidden_size, dtype=runner.dtype, device=dev)
        self.use_embeds = torch.zeros(batch, dtype=torch.bool, device=dev)
        self._embeds_dirty = False
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        args = (self.ids, self.pos, self.write, self.table, self.embeds, self.use_embeds)

        def body() -> Outputs:
            hidden, step_logits = runner.decode_forward_static(*args)
            # The logits land in a buffer that every graph of this row bucket shares (made outside the
            # graph pool by the warm-up passes before the capture): kept per graph they were the bulk of
            # the pool (rows x vocabulary for each context bucket, ~0.5 GB with 128-row buckets), and
            # steps run one at a time, so a step's logits are read before the next replay writes them.
            logits = runner.row_logits_buffer(batch, step_logits)
            logits.copy_(step_logits)
            # Greedy picks inside the graph: an all-greedy step then reads back B ids, with no logits
            # conversion, stack or argmax launched after the replay.
            torch.argmax(logits, dim=-1, out=self.tokens)
            return hidden, logits

        capture = runner.graph_capture or capture_cuda_graph
        self._replay, (self.hidden, self.logits) = capture(runner, body)

    def run(
        self,
        rows: Sequence[DecodeRow],
        embeds: Sequence[tuple[int, torch.Tensor]] = (),
        ids_from: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay on ``rows``; ``ids_from`` (device ids) replaces the first rows' host token ids.

        ``ids_from`` is how a chained decode step (:mod:`services.thinker.overlap`) feeds the previous
        step's in-graph argmax without the host having read it: the copy is queued after the staging
        upload and before the replay, so stream order alone makes it see the finished argmax.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host mirror
        fill_rows(rows, self.block_size, self._host_np, self.batch, self.blocks)
        self.staging.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if ids_from is not None:
            self.ids[: ids_from.shape[0]].copy_(ids_from)
        if self._embeds_dirty:
            self.use_embeds.zero_()
            self._embeds_dirty = False
        for row, e in embeds:
            self.embeds[row : row + e.shape[0]].copy_(e, non_blocking=True)
            self.use_embeds[row : row + e.shape[0]] = True
            self._embeds_dirty = True
        self._replay()
        return self.hidden, self.logits
