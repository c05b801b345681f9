"""Batched duplex unit encoding: the pending units of every session in one streaming-Whisper pass.

Each duplex session sends one 1 s unit a second, and every unit needs its mel chunk, its rows from the
session's incremental Whisper and its merged embeddings before the engine can decide it. Encoded one
session at a time, 16 sessions cost 16 encoder passes a second, each a few hundred small kernel
launches from Python against the engine thread for the GIL (496 ms a unit on the H200 at 16 sessions).

Encoding is split from assembly so that it can run ahead: a unit's audio and frames do not depend on
the previous unit's decision, but its token layout does (it re-injects that unit's terminator). So
:class:`DuplexUnitEncoder` returns :class:`~services.thinker.duplex.EncodedAudio` (the encoder rows), and
the stream (:mod:`services.thinker.duplex_stream`) encodes the next queued unit while the engine still
decodes the current one, then assembles it (:meth:`DuplexSession.assemble_unit`: layout, merged
embeddings, decision policy) the moment that unit is decided.

The encoder queues the units the sessions hand it and drains the queue on the thinker's encode
executor: every unit waiting when a pass starts goes into that pass, so while one pass runs the next
batch gathers, and the batch grows with the load without any waiting window. One pass
(:func:`encode_audio_units`) is:

1. per unit, on the host: the streaming mel and the frames' slices (:meth:`DuplexSession.prepare_unit`);
2. one :meth:`ThinkerModel.get_audio_embeds_streaming_batch` over all the units (each session keeps its own
   slot of the pooled encoder cache; convolutions, projections, MLPs and attention run batched);
3. the frames' vision rows, per unit that has frames.

A unit's rows and embeddings are the same numbers as when it is encoded alone, to float rounding (the
batched sums run in another order: tests/test_thinker_duplex_encode.py).
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
from services.thinker.duplex import WHISPER_BATCH, DuplexSession, EncodedAudio, PreparedUnit
from services.thinker.model.audio import StreamPiece
from services.thinker.scheduler import WorkItem
from services.thinker.whisper_graph import MAX_PASS_UNITS

if TYPE_CHECKING:
    from services.thinker.backend import ThinkerBackend

log = logging.getLogger(__name__)


AudioRequest = tuple[DuplexSession, thinker_pb2.ThinkerUnit]
UnitRequest = tuple[DuplexSession, thinker_pb2.ThinkerUnit, bool]  # (session, unit, force_speak)


def encode_audio_units(
    backend: ThinkerBackend, requests: Sequence[AudioRequest]
) -> list[EncodedAudio | BaseException]:
    """One encoder pass over ``requests`` (at most one unit per session): each unit's encoder rows, or its
    error. A unit's own bad input (a :class:`StageError` while preparing it) fails that unit only; an
    encoder failure fails every unit of the pass."""
    results: list[EncodedAudio | BaseException | None] = [None] * len(requests)
    prepared: list[tuple[int, PreparedUnit]] = []
    for i, (session, unit) in enumerate(requests):
        try:
            prepared.append((i, session.prepare_unit(unit)))
        except StageError as err:
            results[i] = err
    if prepared:
        try:
            encoded: Sequence[EncodedAudio | BaseException] = _encode_prepared(
                backend, [p for _, p in prepared]
            )
        except Exception as exc:  # noqa: BLE001 (handed to every unit of the pass, which types it)
            encoded = [exc] * len(prepared)
        for (i, _), item in zip(prepared, encoded, strict=True):
            results[i] = item
    return [r if r is not None else RuntimeError("unit not encoded") for r in results]


def encode_units(backend: ThinkerBackend, requests: Sequence[UnitRequest]) -> list[WorkItem | BaseException]:
    """One encoder pass, then each unit assembled into its work item right away (callers that run a
    session's units one after another, deciding each before the next: the fidelity dump, tests)."""
    encoded = encode_audio_units(backend, [(session, unit) for session, unit, _ in requests])
    out: list[WorkItem | BaseException] = []
    for (session, _, force_speak), enc in zip(requests, encoded, strict=True):
        if isinstance(enc, BaseException):
            out.append(enc)
            continue
        try:
            out.append(session.assemble_unit(enc, force_speak))
        except StageError as err:
            out.append(err)
    return out


def encode_unit(
    backend: ThinkerBackend, session: DuplexSession, unit: thinker_pb2.ThinkerUnit, force_speak: bool
) -> WorkItem:
    """One unit encoded alone: the same path as a batch of one (the fidelity dump drives units this way)."""
    (out,) = encode_units(backend, [(session, unit, force_speak)])
    if isinstance(out, BaseException):
        raise out
    return out


@torch.inference_mode()
def _encode_prepared(backend: ThinkerBackend, units: Sequence[PreparedUnit]) -> list[EncodedAudio]:
    model = backend.model
    pieces = [
        StreamPiece(u.chunk.core, u.session.audio_state, u.chunk.lookahead, u.chunk.lookbehind) for u in units
    ]
    audio = model.get_audio_embeds_streaming_batch(pieces)  # [B, rows, H]
    WHISPER_BATCH.observe(len(units))
    out: list[EncodedAudio] = []
    for u, rows in zip(units, audio.unbind(0), strict=True):
        if rows.shape[0] != u.audio_rows:
            raise RuntimeError(f"the encoder gave {rows.shape[0]} audio rows for a {u.audio_rows}-row layout")
        vision = model.get_vision_embeds(u.slices, u.tgt).reshape(-1, rows.shape[-1]) if u.slices else None
        out.append(EncodedAudio(u, rows.detach(), vision.detach() if vision is not None else None))
    return out


@dataclass
class _Pending:
    request: AudioRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[EncodedAudio]


class DuplexUnitEncoder:
    """Gathers the sessions' units and encodes whatever is waiting in one pass on the encode executor.

    At most one pass runs at a time (the other executor thread stays free for session prefixes and window
    trims); the thread that finishes a pass starts the next one with everything that arrived meanwhile.
    """

    def __init__(self, backend: ThinkerBackend, max_batch: int = MAX_PASS_UNITS) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._draining = False

    async def encode(self, session: DuplexSession, unit: thinker_pb2.ThinkerUnit) -> EncodedAudio:
        """The unit's encoder rows, from the next pass together with every other waiting unit."""
        loop = asyncio.get_running_loop()
        pending = _Pending((session, unit), loop, loop.create_future())
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
                results = encode_audio_units(self.backend, [p.request for p in batch])
            except Exception as exc:  # noqa: BLE001 (never leave a session waiting forever)
                log.exception("duplex encoder pass failed")
                results = [exc] * len(batch)
            for pending, result in zip(batch, results, strict=True):
                try:
                    pending.loop.call_soon_threadsafe(_resolve, pending.future, result)
                except RuntimeError:  # the session's event loop has closed: nobody waits for it
                    pass


def _resolve(future: asyncio.Future[EncodedAudio], result: EncodedAudio | BaseException) -> None:
    if future.done():  # the session stopped waiting (cancelled)
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
