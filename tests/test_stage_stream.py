"""The gateway's stage stream when its peer dies while one task writes and another reads.

A chat's code2wav stream is written by the talker pump and read by the code2wav pump. When the stage is
SIGKILLed before its first output both tasks meet the failure together; the stream must spend its one
retry once, replay what was written in order and exactly once, and end both tasks with a 503
``StageFailure`` when nothing is left to retry on. The peer is a real gRPC server process
(``tests/stream_peer.py``) that records what it received; it is killed for real.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stage_processes import REPO, free_port

from gateway.metrics import STAGE_RETRIES
from gateway.stage_clients import StageClient
from gateway.stage_failure import StageFailure
from gateway.stage_stream_client import StageStream
from services.common.pb import code2wav_pb2, common_pb2

WINDOWS = 300
KILL_AFTER = 60  # windows written before the first peer is killed


class Peer:
    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "stream_peer.py"), str(self.port), str(log_path)],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, "the peer exited"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert time.monotonic() < deadline, "the peer did not listen"
            time.sleep(0.05)

    def received(self) -> list[str]:
        return self.log_path.read_text().splitlines() if self.log_path.exists() else []

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[list[Peer]]:
    started = [Peer(tmp_path / f"peer{i}.log") for i in range(2)]
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.kill()


def _window(seq: int) -> code2wav_pb2.Code2WavRequest:
    ident = common_pb2.Identity(request_id="r", chunk_seq=seq)
    return code2wav_pb2.Code2WavRequest(window=common_pb2.CodecWindow(id=ident, codes=[seq]))


def _open() -> code2wav_pb2.Code2WavRequest:
    return code2wav_pb2.Code2WavRequest(
        open=code2wav_pb2.Code2WavOpen(id=common_pb2.Identity(request_id="r"))
    )


async def _write_all(stream: StageStream, first: Peer) -> None:
    """The talker pump's part: windows as fast as flow control lets them go, the first peer SIGKILLed
    once it has received some, then half-close."""
    for seq in range(WINDOWS):
        await stream.write(_window(seq))
        if seq == KILL_AFTER:
            while len(first.received()) < 2:  # it got the open and at least one window
                await asyncio.sleep(0.01)
            first.kill()
        await asyncio.sleep(0)
    await stream.done_writing()


async def _read_all(stream: StageStream) -> list[str]:
    """The code2wav pump's part: read to the end."""
    return [msg.WhichOneof("kind") async for msg in stream.responses()]


def _retries() -> float:
    return STAGE_RETRIES.labels("code2wav")._value.get()


def test_replay_after_a_kill_is_in_order_and_once(peers: list[Peer]) -> None:
    """Two replicas; the first dies mid-stream: the second receives the open and every window exactly
    once, in order, although the writer kept writing while the reader's reopen replayed."""

    async def scenario() -> list[str]:
        client = StageClient("code2wav", ",".join(f"127.0.0.1:{p.port}" for p in peers))
        try:
            stream = client.open_stream(deadline_s=60)
            await stream.write(_open())
            reading = asyncio.create_task(_read_all(stream))
            async with asyncio.timeout(30):
                await _write_all(stream, peers[0])
                return await reading
        finally:
            await client.close()

    before = _retries()
    assert asyncio.run(scenario()) == ["done"]
    assert _retries() - before == 1
    assert peers[1].received() == ["open 0", *(f"window {seq}" for seq in range(WINDOWS))]


def test_alone_and_killed_both_tasks_get_503(peers: list[Peer]) -> None:
    """One replica, killed mid-stream: the single retry is spent once and the reader and the writer
    both end with a 503 StageFailure (neither hangs nor ends with a stray CancelledError)."""
    peers[1].kill()

    async def scenario() -> list[BaseException | None]:
        client = StageClient("code2wav", f"127.0.0.1:{peers[0].port}")
        try:
            stream = client.open_stream(deadline_s=60)
            await stream.write(_open())
            tasks = [
                asyncio.create_task(_read_all(stream)),
                asyncio.create_task(_write_all(stream, peers[0])),
            ]
            async with asyncio.timeout(20):
                await asyncio.wait(tasks)
            return [t.exception() if not t.cancelled() else asyncio.CancelledError() for t in tasks]
        finally:
            await client.close()

    before = _retries()
    outcomes = asyncio.run(scenario())
    assert all(isinstance(e, StageFailure) and e.status == 503 for e in outcomes), outcomes
    assert _retries() - before == 1
