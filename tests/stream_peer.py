"""A bare gRPC peer for the gateway's stream client tests: ``python tests/stream_peer.py PORT LOG``.

It serves ``Code2WavService.Generate`` at the wire level only: every request it receives is appended to
LOG as one line (``open 0`` / ``window <chunk_seq>``), nothing is answered until the client half-closes,
and then it answers one ``Done``. It stands in for a network peer (what was received, in which order),
not for the code2wav stage, so the tests can SIGKILL it mid-stream and read exactly what a replay sent.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2


class RecordingPeer(code2wav_pb2_grpc.Code2WavServiceServicer):
    def __init__(self, log_path: str) -> None:
        self.log_path = log_path

    async def Generate(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[code2wav_pb2.Code2WavRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[code2wav_pb2.Code2WavResponse]:
        with open(self.log_path, "a", buffering=1) as log:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                seq = req.window.id.chunk_seq if kind == "window" else 0
                log.write(f"{kind} {seq}\n")
        yield code2wav_pb2.Code2WavResponse(done=common_pb2.Done())


async def main(port: int, log_path: str) -> None:
    server = grpc.aio.server()
    code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(RecordingPeer(log_path), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
