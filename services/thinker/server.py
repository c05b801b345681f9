"""Thin gRPC front of the Thinker: ``GetInfo``, ``Generate`` and ``EncodeVoice`` (voice registry).

``ThinkerService.Generate`` is one bidirectional stream per chat request (turn mode) or per duplex
session (``ThinkerOpen.mode``). The skeleton every stage shares (handshake, request pump, the epoch
rule, typed errors, stream metrics, refusal while draining) is :mod:`services.common.stage_stream`;
the per-stream part is :class:`~services.thinker.turn_stream.TurnStream` or
:class:`~services.thinker.duplex_stream.DuplexStream`. Closing the stream (client gone, cancel,
deadline) closes the engine sequence, which frees its KV on the next engine iteration. The backend is
built by :mod:`services.thinker.backend`, the process by :mod:`services.thinker.__main__`; health,
reflection, metrics and graceful drain come from :mod:`services.common.grpc_server`.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.errors import StageError
from services.common.grpc_server import ServeOptions, StageServer
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.stage_stream import StageServicer, StageStream, StageStreamDriver
from services.thinker.backend import ThinkerBackend, stage_info
from services.thinker.duplex_stream import DuplexStream
from services.thinker.engine import STAGE
from services.thinker.errors import ProcessorError
from services.thinker.turn_stream import TurnStream
from services.thinker.voice import encode_voice

SERVICE_NAME = "minicpmo.v1.ThinkerService"


class ThinkerServicer(StageServicer, thinker_pb2_grpc.ThinkerServiceServicer):
    def __init__(self, backend: ThinkerBackend, info: common_pb2.StageInfo) -> None:
        self.backend = backend
        self.info = info
        self.driver = StageStreamDriver(
            STAGE, thinker_pb2.ThinkerRequest, thinker_pb2.ThinkerResponse, self._stream_for
        )

    @property
    def draining(self) -> bool:
        """Set by the drain hook: new streams are refused, open ones finish."""
        return self.driver.draining

    async def EncodeVoice(  # noqa: N802
        self, request: thinker_pb2.ThinkerVoiceRequest, context: grpc.aio.ServicerContext
    ) -> thinker_pb2.VoiceEmbedding:
        """A reference clip's audio-encoder rows, computed once for the voice registry."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.backend.executor, encode_voice, self.backend, request)
        except (StageError, ProcessorError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, getattr(exc, "message", None) or str(exc))
            raise  # abort raises; this line is for the type checker

    def _stream_for(self, open_msg: thinker_pb2.ThinkerOpen) -> StageStream[thinker_pb2.ThinkerResponse]:
        if open_msg.mode == common_pb2.STREAM_MODE_DUPLEX:
            return DuplexStream(self.backend, open_msg)
        return TurnStream(self.backend, open_msg)


def make_server(backend: ThinkerBackend, options: ServeOptions) -> StageServer:
    servicer = ThinkerServicer(backend, stage_info(backend))

    async def drain() -> None:
        servicer.driver.draining = True
        while not backend.engine.is_idle():
            await asyncio.sleep(0.05)

    stage_server = StageServer(
        STAGE,
        SERVICE_NAME,
        lambda server: thinker_pb2_grpc.add_ThinkerServiceServicer_to_server(servicer, server),
        options,
        drain=drain,
    )
    stage_server.servicer = servicer  # type: ignore[attr-defined]  # tests and operators inspect drain state
    return stage_server
