"""Batched duplex unit encoding: the pending units of every session in one streaming-Whisper pass.

Each duplex session sends one 1 s unit a second, and every unit needs its mel chunk, its rows from the
session's incremental Whisper and its merged embeddings before the engine can decide it. Encoded one
session at a time, 16 sessions cost 16 encoder passes a second, each a few hundred small kernel
launches from Python against the engine thread for the GIL (496 ms a unit on the H200 at 16 sessions).

:class:`DuplexUnitEncoder` queues the units the sessions hand it and drains the queue on the thinker's
encode executor: every unit waiting when a pass starts goes into that pass, so while one pass runs the
next batch gathers, and the batch grows with the load without any waiting window. One pass
(:func:`encode_units`) is:

1. per unit, on the host: the streaming mel and the token layout (:meth:`DuplexSession.prepare_unit`);
2. one :meth:`ThinkerModel.get_audio_embeds_streaming_batch` over all the units (each session keeps its own
   encoder cache; projections and MLPs run batched, attention per cache);
3. the frames' vision rows, per unit that has frames;
4. one :meth:`ThinkerModel.merge_embeddings` over the units' layouts laid end to end, cut back per unit;
5. per unit, its work item with its decision policy (:meth:`DuplexSession.finish_unit`).

A unit's rows and embeddings are the same numbers as when it is encoded alone (bit for bit on CPU fp32:
tests/test_thinker_duplex_encode.py), so batching changes nothing the model sees.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.errors import StageError
from services.common.pb import thinker_pb2
from services.thinker.duplex import WHISPER_BATCH, DuplexSession, PreparedUnit
from services.thinker.model.audio import StreamPiece
from services.thinker.scheduler import WorkItem

if TYPE_CHECKING:
    from services.thinker.backend import ThinkerBackend

log = logging.getLogger(__name__)

MAX_BATCH = 32  # units per encoder pass; more than the 1-GPU profile's sessions, so a pass takes them all

UnitRequest = tuple[DuplexSession, thinker_pb2.ThinkerUnit, bool]  # (session, unit, force_speak)


def encode_units(backend: ThinkerBackend, requests: Sequence[UnitRequest]) -> list[WorkItem | BaseException]:
    """One encoder pass over ``requests`` (at most one unit per session); a work item or the error per unit.

    A unit's own bad input (a :class:`StageError` while preparing it) fails that unit only; an encoder
    failure fails every unit of the pass.
    """
    results: list[WorkItem | BaseException | None] = [None] * len(requests)
    prepared: list[tuple[int, PreparedUnit]] = []
    for i, (session, unit, force_speak) in enumerate(requests):
        try:
            prepared.append((i, session.prepare_unit(unit, force_speak)))
        except StageError as err:
            results[i] = err
    if prepared:
        try:
            items = _encode_prepared(backend, [p for _, p in prepared])
        except Exception as exc:  # noqa: BLE001 (handed to every unit of the pass, which types it)
            items = [exc] * len(prepared)
        for (i, _), item in zip(prepared, items, strict=True):
            results[i] = item
    return [r if r is not None else RuntimeError("unit not encoded") for r in results]


def encode_unit(
    backend: ThinkerBackend, session: DuplexSession, unit: thinker_pb2.ThinkerUnit, force_speak: bool
) -> WorkItem:
    """One unit encoded alone: the same path as a batch of one (the fidelity dump drives units this way)."""
    (out,) = encode_units(backend, [(session, unit, force_speak)])
    if isinstance(out, BaseException):
        raise out
    return out


@torch.inference_mode()
def _encode_prepared(
    backend: ThinkerBackend, units: Sequence[PreparedUnit]
) -> list[WorkItem | BaseException]:
    model = backend.model
    pieces = [
        StreamPiece(u.chunk.core, u.session.audio_state, u.chunk.lookahead, u.chunk.lookbehind) for u in units
    ]
    audio = model.get_audio_embeds_streaming_batch(pieces)  # [B, rows, H]
    WHISPER_BATCH.observe(len(units))
    ids: list[int] = []
    image_bounds: list[tuple[int, int]] = []
    audio_bounds: list[tuple[int, int]] = []
    vision: list[torch.Tensor] = []
    for u in units:
        offset = len(ids)
        ids.extend(u.layout.input_ids)
        image_bounds.extend((s + offset, e + offset) for s, e in u.layout.image_bounds)
        audio_bounds.extend((s + offset, e + offset) for s, e in u.layout.audio_bounds)
        if u.slices:
            vision.append(model.get_vision_embeds(u.slices, u.tgt))
    merged = model.merge_embeddings(
        torch.tensor(ids, dtype=torch.long),
        torch.cat(vision) if vision else None,
        torch.tensor(image_bounds, dtype=torch.long).reshape(-1, 2),
        list(audio.unbind(0)),
        torch.tensor(audio_bounds, dtype=torch.long).reshape(-1, 2),
    ).detach()
    out: list[WorkItem | BaseException] = []
    offset = 0
    for u in units:
        n = len(u.layout.input_ids)
        out.append(u.session.finish_unit(u, merged[offset : offset + n]))
        offset += n
    return out


@dataclass
class _Pending:
    request: UnitRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[WorkItem]


class DuplexUnitEncoder:
    """Gathers the sessions' units and encodes whatever is waiting in one pass on the encode executor.

    At most one pass runs at a time (the other executor thread stays free for session prefixes and window
    trims); the thread that finishes a pass starts the next one with everything that arrived meanwhile.
    """

    def __init__(self, backend: ThinkerBackend, max_batch: int = MAX_BATCH) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._draining = False

    async def encode(
        self, session: DuplexSession, unit: thinker_pb2.ThinkerUnit, force_speak: bool
    ) -> WorkItem:
        """The unit's work item, encoded in the next pass together with every other waiting unit."""
        loop = asyncio.get_running_loop()
        pending = _Pending((session, unit, force_speak), loop, loop.create_future())
        with self._lock:
            self._queue.append(pending)
            start = not self._draining
            self._draining = True
        if start:
            self.backend.executor.submit(self._drain)
        return await pending.future

    def _drain(self) -> None:
        """Encoder passes until the queue is empty (runs on the encode executor)."""
        while True:
            with self._lock:
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
                if not batch:
                    self._draining = False
                    return
            try:
                results = encode_units(self.backend, [p.request for p in batch])
            except Exception as exc:  # noqa: BLE001 (never leave a session waiting forever)
                log.exception("duplex encoder pass failed")
                results = [exc] * len(batch)
            for pending, result in zip(batch, results, strict=True):
                try:
                    pending.loop.call_soon_threadsafe(_resolve, pending.future, result)
                except RuntimeError:  # the session's event loop has closed: nobody waits for it
                    pass


def _resolve(future: asyncio.Future[WorkItem], result: WorkItem | BaseException) -> None:
    if future.done():  # the session stopped waiting (cancelled)
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
