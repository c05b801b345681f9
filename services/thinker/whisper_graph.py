"""The streaming-Whisper layers of a duplex encode pass as one CUDA graph replay per batch bucket.

Why: an encode pass (:func:`services.thinker.duplex_encode.encode_audio_units`) is about 900 aten
operators at full size, each a kernel launch from the encode thread, which shares the GIL with the engine
thread. Alone on an H100 a pass over 16 sessions took 16.2 ms; at 16 live sessions a unit's encode took
58 ms (BENCHMARKS.md), and it lies on the path from a commit to the first audio. Replayed from a graph,
the layers are a few input copies and one launch.

What is captured: :meth:`WhisperChunkedEncoder.stream_layers_fixed`. That is the positions, every layer
(the pooled cache's write, its gather, attention, the MLP) and the final norm. Its shapes are fixed:

* the pass's rows are padded to a bucket (1, 2, 4, ... up to the sessions the thinker holds);
* a piece is one 1 s unit (50 encoder frames);
* attention reads every one of a slot's ``max_source_positions`` frames and masks the frames past the
  row's end, so the shapes do not depend on how far each stream has got.

The convolutions (whose windows depend on a stream's left context) and the projector stay eager; they
are a handful of launches.

Off by default: the thinker captures these graphs only with ``--whisper-graphs`` (profile key
``stages.thinker.whisper_graphs``), until a GPU run has compared them with the eager pass and measured
what they change at a duplex load.

Padding rows write their keys and values into the pool's scratch slot, which no session holds, and their
outputs are dropped. The graphs read the pooled cache tensor they were captured on. If the pool ever
grows (more sessions encode at once than it was reserved for, which it logs), passes run eagerly from
then on, and this is logged once.

A row equals the eager pass's row to float rounding: the extra masked keys change how the attention
kernel blocks its sums, not the weights. tests/test_thinker_whisper_graph.py checks this on the CPU with
an emulated capture; ``python -m bench.thinker.whisper_pass --graphs`` compares the replay with the eager
pass on a GPU and times both.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.common.cuda_graphs import Capture, ShapeKeyedGraphs, SharedBuffers, capture_cuda_graph
from services.common.device import to_device

if TYPE_CHECKING:
    from services.thinker.model.audio import WhisperChunkedEncoder
    from services.thinker.model.thinker import ThinkerModel

log = logging.getLogger(__name__)

UNIT_FRAMES = 50  # encoder frames of a 1 s duplex unit (100 mel frames, conv stride 2)
# Units per encoder pass: more than the 1-GPU profile's sessions, so a pass takes them all.
MAX_PASS_UNITS = 32


def encode_batch_limit(max_num_seqs: int) -> int:
    """The most units one pass holds when the thinker runs ``max_num_seqs`` sequences: one unit per
    session, the sessions being the running sequences and the two the KV reserve lets wait."""
    return min(MAX_PASS_UNITS, max_num_seqs + 2)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds ``max_batch`` rows."""
    out = [1]
    while out[-1] < max_batch:
        out.append(2 * out[-1])
    return out


def reserve_bytes(model: ThinkerModel, max_batch: int, device: torch.device) -> int:
    """Device bytes the graphs add on ``device`` beyond the sessions' caches: the scratch slot, and the
    largest graph's intermediates (its per-layer gather of every row's keys and values over all frames,
    and the attention's masked scores, with room to spare). 0 where no graph is captured (off CUDA)."""
    if device.type != "cuda":
        return 0
    a = model.dims.audio
    elem = model.apm.conv1.weight.element_size()
    rows = batch_buckets(max_batch)[-1]
    return model.audio_stream_bytes() + 4 * rows * a.max_source_positions * a.d_model * elem


class WhisperStreamGraphs:
    """The captured layer stacks of one encoder, keyed by batch bucket (see the module docstring)."""

    def __init__(
        self, encoder: WhisperChunkedEncoder, max_batch: int, capture: Capture | None = None
    ) -> None:
        self.encoder = encoder
        self.buckets = batch_buckets(max_batch)
        if capture is None:
            capture = functools.partial(
                capture_cuda_graph, pool=torch.cuda.graph_pool_handle(), shared=SharedBuffers()
            )
        self.graphs = ShapeKeyedGraphs("whisper_stream", self._fixed, capture=capture)
        self.pool_tensor: torch.Tensor | None = None  # the pooled cache the graphs were captured on
        self.scratch = 0
        self._pool_moved_logged = False

    def _fixed(
        self, x: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor, key_mask: torch.Tensor
    ) -> tuple[torch.Tensor]:
        return (self.encoder.stream_layers_fixed(x, slots, frames, key_mask),)

    def _inputs(
        self, x: torch.Tensor, slots: Sequence[int], starts: Sequence[int], bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded inputs of a pass of ``len(slots)`` rows: padding rows take the scratch slot from frame 0."""
        rows, n, width = x.shape
        dev = x.device
        padded = x if rows == bucket else torch.cat([x, x.new_zeros(bucket - rows, n, width)])
        slot_ids = torch.full((bucket,), self.scratch, dtype=torch.long)
        begin = torch.zeros(bucket, dtype=torch.long)
        if rows:
            slot_ids[:rows] = torch.tensor(list(slots), dtype=torch.long)
            begin[:rows] = torch.tensor(list(starts), dtype=torch.long)
        frames = begin[:, None] + torch.arange(n)[None, :]
        span = self.encoder.embed_positions.num_embeddings
        key_mask = (torch.arange(span)[None, :] < (begin + n)[:, None])[:, None, None, :]
        return padded, to_device(slot_ids, dev), to_device(frames, dev), to_device(key_mask, dev)

    def run(self, x: torch.Tensor, slots: Sequence[int], starts: Sequence[int]) -> torch.Tensor | None:
        """The pass's layers from the graph of its bucket, or None (eager) when no graph can serve it.

        Called by :meth:`WhisperChunkedEncoder.forward_chunks` holding the pool's pass lock, so one replay
        of this set runs at a time; the output is copied out of the shared output arena before returning.
        """
        rows, n, _ = x.shape
        if self.encoder.stream_pool.tensor is not self.pool_tensor:
            if not self._pool_moved_logged:
                self._pool_moved_logged = True
                log.warning("streaming-Whisper cache was reallocated: encoder passes run eagerly from now on")
            return None
        if n != UNIT_FRAMES or not 0 < rows <= self.buckets[-1]:
            return None
        bucket = next(b for b in self.buckets if b >= rows)
        (out,) = self.graphs(*self._inputs(x, slots, starts, bucket))
        return out[:rows].clone()

    @torch.inference_mode()
    def warmup(self) -> int:
        """Allocate the pooled cache, take its scratch slot, capture every bucket (largest first, so the
        shared arenas reach their size at once) and freeze the set; returns the graphs held."""
        encoder = self.encoder
        like = encoder.conv1.weight
        pool = encoder.stream_pool
        with pool.pass_lock:
            self.pool_tensor = pool.allocate(like)
            self.scratch = pool.take_scratch(like)
            for bucket in reversed(self.buckets):
                none = torch.zeros(0, UNIT_FRAMES, encoder.dims.d_model, dtype=like.dtype, device=like.device)
                self.graphs(*self._inputs(none, [], [], bucket))  # padding rows only
        self.graphs.frozen = True
        if like.device.type == "cuda":
            torch.cuda.synchronize(like.device)
        return self.graphs.captured


def warmup_whisper_stream_graphs(
    encoder: WhisperChunkedEncoder, max_batch: int, capture: Capture | None = None
) -> int:
    """Capture the duplex encoder's layer stack for up to ``max_batch`` sessions a pass and route passes
    through it; returns the graphs captured (0 off CUDA, unless a test passes an emulated ``capture``).

    Call at start-up, before the engine and encode threads run, and before any pass (the pooled cache is
    allocated here with one more slot than reserved, the scratch slot)."""
    if capture is None and encoder.conv1.weight.device.type != "cuda":
        return 0
    pool = encoder.stream_pool
    if pool.tensor is None:
        pool.capacity += 1  # the scratch slot
    graphs = WhisperStreamGraphs(encoder, max_batch, capture)
    captured = graphs.warmup()
    encoder.stream_graphs = graphs
    return captured
