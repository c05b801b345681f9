"""A bad replica behind a replica list, with its peer still answering (real processes, tiny checkpoint).

The health monitor probes every replica of a list on its own channel, so a replica that stopped
answering (SIGSTOP: its TCP connection stays open, nothing is refused) or died is found even while the
other replica answers: ``/health`` stays 200 but says ``degraded`` and names the bad address, the stream
open to it fails within the probe bound while the stream on the healthy replica carries on, and new
requests all land on the healthy replica. Once the replica resumes it takes its turns again.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_server import ThreadedGateway
from stage_processes import StageProcess, start_stages, stop_all

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {"thinker": {"sampling": {"max_tokens": 8}}, "talker": {"sampling": {"max_new_frames": 25}}}
# Long enough that only cancellation ends it within the test's waits.
LONG_SPEECH = {
    "stream": True,
    "max_tokens": 400,
    "sampling_params_list": [{"max_tokens": 400, "ignore_eos": True}, {"max_tokens": 2000}],
}
DETECT_BOUND_S = 3.5  # two missed 1 s probes 0.5 s apart, plus CPU contention


@pytest.fixture(scope="module")
def procs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[StageProcess]]:
    started = start_stages(
        tiny_ckpt,
        tmp_path_factory.mktemp("replica_logs"),
        [("thinker", []), ("talker", []), ("code2wav", []), ("code2wav", [])],
    )
    try:
        yield started
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def gateway(procs: list[StageProcess]) -> Iterator[ThreadedGateway]:
    thinker, talker, a, b = procs
    addrs = {"thinker": thinker.addr, "talker": talker.addr, "code2wav": f"{a.addr},{b.addr}"}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu").with_overrides(OVERRIDES))
    with ThreadedGateway(config) as gw:
        yield gw


def _chat(**extra: object) -> dict:
    """A spoken chat (speech is asked for: the served default is text only)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
        **extra,
    }


class _Stream(threading.Thread):
    """A streaming chat read in the background; ``events`` are the parsed SSE data lines, with times."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events: list[tuple[float, object]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream(
            "POST", f"{self.url}/v1/chat/completions", json=_chat(**LONG_SPEECH), timeout=300
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
                if self.stop.is_set():
                    return

    def has_audio(self) -> bool:
        return any(isinstance(e, dict) and "audio" in json.dumps(e) for _, e in self.events)


def _wait(cond, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=10)
    return r.status_code, r.json()


def _audio_chat(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["audio"]["data"]


def test_health_lists_every_replica(gateway: ThreadedGateway, procs: list[StageProcess]) -> None:
    _, _, a, b = procs
    status, body = _health(gateway.url)
    assert status == 200 and body["status"] == "healthy"
    assert body["stages"] == {"thinker": "ok", "talker": "ok", "code2wav": "ok"}
    assert body["replicas"]["code2wav"] == {a.addr: "ok", b.addr: "ok"}


def _start_on_each(url: str, a: StageProcess, b: StageProcess) -> dict[str, _Stream]:
    """Open streaming speech chats until one runs on each replica (round-robin: two, usually)."""
    streams: dict[str, _Stream] = {}
    for _ in range(4):
        before = {p.addr: p.metric("minicpmo_stage_streams_active") for p in (a, b)}
        stream = _Stream(url)
        stream.start()
        _wait(stream.has_audio, 120, "first audio")
        after = {p.addr: p.metric("minicpmo_stage_streams_active") for p in (a, b)}
        landed = next(addr for addr in after if after[addr] > before[addr])
        if landed in streams:
            stream.stop.set()
            continue
        streams[landed] = stream
        if len(streams) == 2:
            return streams
    raise AssertionError(f"streams never reached both replicas: {list(streams)}")


def test_stopped_replica_is_named_routed_around_and_its_stream_failed(
    gateway: ThreadedGateway, procs: list[StageProcess]
) -> None:
    _, _, a, b = procs
    streams = _start_on_each(gateway.url, a, b)
    b.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        on_b, on_a = streams[b.addr], streams[a.addr]
        _wait(
            lambda: on_b.events and on_b.events[-1][1] == "[DONE]",
            30,
            "the stream on the stopped replica to end",
        )
        error_s = on_b.events[-1][0] - stopped_at
        err = on_b.events[-2][1]["error"]  # type: ignore[index]
        assert err["code"] == 503 and "code2wav" in err["message"] and b.addr in err["message"], err
        assert error_s <= DETECT_BOUND_S, error_s
        print(f"FIGURE replica_sigstop_error_s={error_s:.2f}")
        # the stream on the healthy replica goes on after the stopped one failed
        seen = len(on_a.events)
        _wait(lambda: len(on_a.events) > seen + 2, 60, "the stream on the healthy replica to go on")
        assert not any(isinstance(e, dict) and "error" in e for _, e in on_a.events)
        on_a.stop.set()
        status, body = _health(gateway.url)
        assert status == 200 and body["status"] == "degraded", body
        assert body["replicas"]["code2wav"][a.addr] == "ok"
        assert body["replicas"]["code2wav"][b.addr] != "ok"
        assert body["stages"]["code2wav"].startswith("degraded") and b.addr in body["stages"]["code2wav"]
        before = a.streams_opened()
        for _ in range(3):
            _audio_chat(gateway.url)  # none of them may wait on the stopped replica
        assert a.streams_opened() == before + 3
    finally:
        b.proc.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    _wait(lambda: _health(gateway.url)[1]["status"] == "healthy", 10, "/health healthy after SIGCONT")
    print(f"FIGURE replica_sigcont_healthy_s={time.monotonic() - resumed_at:.2f}")
    opened = [p.streams_opened() for p in (a, b)]
    for _ in range(2):
        _audio_chat(gateway.url)
    assert [p.streams_opened() - o for p, o in zip((a, b), opened, strict=True)] == [1, 1]


def test_dead_replica_is_named_and_skipped(gateway: ThreadedGateway, procs: list[StageProcess]) -> None:
    _, _, a, b = procs
    b.kill()
    named_s = _wait(
        lambda: b.addr in _health(gateway.url)[1]["stages"]["code2wav"],
        2.0,
        "/health naming the dead replica",
    )
    print(f"FIGURE replica_kill_health_s={named_s:.2f}")
    status, body = _health(gateway.url)
    assert status == 200 and body["status"] == "degraded" and body["replicas"]["code2wav"][a.addr] == "ok"
    before = a.streams_opened()
    for _ in range(3):
        _audio_chat(gateway.url)
    assert a.streams_opened() == before + 3
