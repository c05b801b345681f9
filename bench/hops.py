"""What the service split costs per message: each pipeline hop over gRPC vs the same hand-off in one process.

    python -m bench.hops [--device cuda] [--iters 2000] [--out-dir DIR]

The pipeline moves five kinds of messages across process boundaries (the gateway relays between stages):

=====================  =================  ======================================================
hop                    message            realistic payload
=====================  =================  ======================================================
thinker -> gateway     ThinkerResponse    SpeechChunk: 10 token ids + hidden [10, 4096] bf16 (80 KiB)
gateway -> talker      TalkerRequest      TalkerChunk: the same ids + hidden, copied as the gateway does
talker -> gateway      TalkerResponse     CodecWindow: 3 left-context + 25 codes
gateway -> code2wav    Code2WavRequest    the same window
code2wav -> gateway    Code2WavResponse   AudioChunk: 1 s of 24 kHz s16le PCM (47 KiB)
=====================  =================  ======================================================

How it is measured (all over loopback TCP, the launcher's layout):

* Two "stage" processes (``python -m bench.hops serve``) run the real stage plumbing,
  :class:`services.common.grpc_server.StageServer` (same channel options, health, reflection), with a
  bench service whose methods use the real message types: ``Emit/<kind>`` sends one message per "go"
  from the client, ``Absorb/<kind>`` receives messages and acks each one.
* This process plays the gateway. For a hop *out of* a stage the stage stamps ``t0`` just before it
  builds the message (tensor -> proto on the stage's device, as the servers do) and the gateway stamps
  ``t1`` once it holds the decoded message; for a hop *into* a stage the gateway stamps ``t0`` before
  building (copying protos, as :mod:`gateway.pipeline` does) and the stage stamps ``t1`` after decoding
  (proto -> tensor on its device, as the servers do). Latency = ``t1 - t0`` on ``CLOCK_MONOTONIC``,
  which every process on the host shares. Messages are paced (the next one leaves after the previous
  one was received), so numbers are per-message latency, not queueing.
* Relays: thinker -> gateway -> talker and talker -> gateway -> code2wav, measured from the first
  stage's stamp to the second stage's stamp through the gateway's copy (two hops + the relay).
* In-process baseline: the same producer/consumer pair as two asyncio tasks in one process handing the
  already-built object (tensor, code list, sample array) through an ``asyncio.Queue`` - what calling the
  engines in one process would cost. ``added`` = gRPC percentile - in-process percentile.

Target (issue 9): added latency <= 1 ms p50 per hop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf import wrappers_pb2

from bench.e2e_client import percentiles
from services.common.grpc_server import GRPC_OPTIONS, ServeOptions, StageServer
from services.common.pb import code2wav_pb2, common_pb2, talker_pb2, thinker_pb2
from services.common.pcm import pcm_from_float, pcm_to_float
from services.common.tensors import tensor_from_proto, tensor_to_proto

SERVICE = "minicpmo.bench.HopBench"
TARGET_ADDED_P50_MS = 1.0
SAMPLE_RATE = 24_000
Go = wrappers_pb2.Int64Value


@dataclass
class Payload:
    """Sizes of the realistic messages."""

    hidden_size: int = 4096
    chunk_tokens: int = 10
    window_codes: int = 28  # 3 left context + 25 new
    audio_samples: int = SAMPLE_RATE  # a 25-frame window is 1 s of audio


class Messages:
    """Builds and consumes each message kind the way the real producer/consumer does."""

    def __init__(self, payload: Payload, device: str) -> None:
        self.p = payload
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(payload.chunk_tokens, payload.hidden_size, generator=gen).to(
            self.device, torch.bfloat16
        )
        self.token_ids = list(range(1000, 1000 + payload.chunk_tokens))
        self.codes = [4218] * 3 + list(range(100, 100 + payload.window_codes - 3))
        self.samples = np.random.default_rng(0).uniform(-0.5, 0.5, payload.audio_samples).astype(np.float32)
        self.hidden_proto = tensor_to_proto(self.hidden, torch.bfloat16)

    @staticmethod
    def ident(seq: int) -> common_pb2.Identity:
        return common_pb2.Identity(request_id="bench-hops", chunk_seq=seq)

    # ---- producers (what the sending process does per message) ----
    def speech(self, seq: int) -> thinker_pb2.ThinkerResponse:
        """Thinker server: device rows -> Tensor proto (D2H on CUDA) in a SpeechChunk."""
        chunk = thinker_pb2.SpeechChunk(
            id=self.ident(seq),
            token_ids=self.token_ids,
            hidden=tensor_to_proto(self.hidden, torch.bfloat16),
            text="ten tokens of spoken text in this chunk",
        )
        return thinker_pb2.ThinkerResponse(speech=chunk)

    def talker_chunk(
        self, seq: int, speech: thinker_pb2.SpeechChunk | None = None
    ) -> talker_pb2.TalkerRequest:
        """Gateway: copies ids + the hidden Tensor proto of a SpeechChunk into a TalkerChunk (no torch)."""
        src = (
            speech
            if speech is not None
            else thinker_pb2.SpeechChunk(token_ids=self.token_ids, hidden=self.hidden_proto)
        )
        return talker_pb2.TalkerRequest(
            chunk=talker_pb2.TalkerChunk(
                id=self.ident(seq), token_ids=src.token_ids, hidden=src.hidden, turn_end=False, is_last=False
            )
        )

    def window_out(self, seq: int) -> talker_pb2.TalkerResponse:
        """Talker server: codes of a finished window -> CodecWindow."""
        return talker_pb2.TalkerResponse(
            window=common_pb2.CodecWindow(id=self.ident(seq), codes=self.codes, left_context=3, is_last=False)
        )

    def window_in(
        self, seq: int, window: common_pb2.CodecWindow | None = None
    ) -> code2wav_pb2.Code2WavRequest:
        """Gateway: copies the talker's window (re-stamped identity) into a Code2WavRequest."""
        out = common_pb2.CodecWindow()
        if window is not None:
            out.CopyFrom(window)
        else:
            out.codes.extend(self.codes)
            out.left_context = 3
        out.id.CopyFrom(self.ident(seq))
        return code2wav_pb2.Code2WavRequest(window=out)

    def audio(self, seq: int) -> code2wav_pb2.Code2WavResponse:
        """Code2wav server: float samples -> s16le PCM in an AudioChunk."""
        return code2wav_pb2.Code2WavResponse(
            audio=code2wav_pb2.AudioChunk(id=self.ident(seq), pcm=pcm_from_float(self.samples, SAMPLE_RATE))
        )

    # ---- consumers (what the receiving process does before it can use the message) ----
    def absorb_talker_chunk(self, msg: talker_pb2.TalkerRequest) -> int:
        """Talker server: Tensor proto -> torch on its device (H2D on CUDA)."""
        hidden = tensor_from_proto(msg.chunk.hidden).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        assert hidden.shape[0] == len(msg.chunk.token_ids)
        return int(msg.chunk.id.chunk_seq)

    @staticmethod
    def absorb_window_in(msg: code2wav_pb2.Code2WavRequest) -> int:
        """Code2wav server: the window's codes as a list."""
        codes = list(msg.window.codes)
        assert codes
        return int(msg.window.id.chunk_seq)

    @staticmethod
    def consume_audio(msg: code2wav_pb2.Code2WavResponse) -> None:
        """Gateway: PCM -> float samples (before encoding for the client)."""
        samples, _ = pcm_to_float(msg.audio.pcm)
        assert samples.size

    @staticmethod
    def consume_window(msg: talker_pb2.TalkerResponse) -> None:
        """Gateway: copies the window out of the response (pipeline.py does the same)."""
        window = common_pb2.CodecWindow()
        window.CopyFrom(msg.window)


# Emit kinds: stage -> gateway (response type); Absorb kinds: gateway -> stage (request type).
EMIT_TYPES: dict[str, Any] = {
    "speech": thinker_pb2.ThinkerResponse,
    "window_out": talker_pb2.TalkerResponse,
    "audio": code2wav_pb2.Code2WavResponse,
}
ABSORB_TYPES: dict[str, Any] = {
    "talker_chunk": talker_pb2.TalkerRequest,
    "window_in": code2wav_pb2.Code2WavRequest,
}


# ---- stage side ----------------------------------------------------------------------------------
class HopStage:
    """The bench service of one stage process; stamps are kept per (method, seq) and fetched at the end."""

    def __init__(self, messages: Messages) -> None:
        self.m = messages
        self.stamps: dict[str, dict[int, int]] = {}

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler] = {}
        for kind, typ in EMIT_TYPES.items():
            methods[f"Emit_{kind}"] = grpc.stream_stream_rpc_method_handler(
                self._emitter(kind),
                request_deserializer=Go.FromString,
                response_serializer=typ.SerializeToString,
            )
        for kind, typ in ABSORB_TYPES.items():
            methods[f"Absorb_{kind}"] = grpc.stream_stream_rpc_method_handler(
                self._absorber(kind),
                request_deserializer=typ.FromString,
                response_serializer=Go.SerializeToString,
            )
        methods["Stamps"] = grpc.unary_unary_rpc_method_handler(
            self._stamps, request_deserializer=bytes, response_serializer=bytes
        )
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _emitter(self, kind: str) -> Callable[..., Any]:
        build = getattr(self.m, kind)

        async def emit(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            stamps = self.stamps.setdefault(f"emit_{kind}", {})
            async for go in requests:
                stamps[go.value] = time.monotonic_ns()
                yield build(go.value)

        return emit

    def _absorber(self, kind: str) -> Callable[..., Any]:
        consume = getattr(self.m, f"absorb_{kind}")

        async def absorb(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            stamps = self.stamps.setdefault(f"absorb_{kind}", {})
            async for msg in requests:
                seq = consume(msg)
                stamps[seq] = time.monotonic_ns()
                yield Go(value=seq)

        return absorb

    async def _stamps(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        data = json.dumps(self.stamps).encode()
        self.stamps = {}
        return data


async def serve(args: argparse.Namespace) -> None:
    stage = HopStage(Messages(Payload(args.hidden_size), args.device))
    server = StageServer(
        "hops",
        SERVICE,
        lambda s: s.add_generic_rpc_handlers((stage.handler(),)),
        ServeOptions(host="127.0.0.1", port=0, metrics_port=0, drain_timeout_s=1.0),
    )
    port = await server.start()
    print(f"PORT {port}", flush=True)
    # Serve until the parent closes our stdin (or dies): no orphan server can outlive the benchmark.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0.5)


# ---- gateway side --------------------------------------------------------------------------------
class StageProc:
    """One ``bench.hops serve`` child; closing its stdin stops it."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.name = name
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.hops",
                "serve",
                "--device",
                args.device,
                "--hidden-size",
                str(args.hidden_size),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"{name}: bench server did not start ({line!r})")
        self.addr = f"127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _method(channel: grpc.aio.Channel, name: str, req: Any, resp: Any) -> Any:
    return channel.stream_stream(
        f"/{SERVICE}/{name}", request_serializer=req.SerializeToString, response_deserializer=resp.FromString
    )


async def _fetch_stamps(channel: grpc.aio.Channel) -> dict[str, dict[int, int]]:
    call = channel.unary_unary(f"/{SERVICE}/Stamps", request_serializer=bytes, response_deserializer=bytes)
    raw = json.loads(await call(b""))
    return {k: {int(s): int(t) for s, t in v.items()} for k, v in raw.items()}


def _latencies_ms(t0: dict[int, int], t1: dict[int, int], skip: int) -> list[float]:
    return [(t1[s] - t0[s]) / 1e6 for s in sorted(t0) if s in t1 and s >= skip]


async def grpc_emit(
    ch: grpc.aio.Channel, kind: str, consume: Callable[[Any], Any], n: int, skip: int
) -> list[float]:
    """Stage -> gateway: stage stamps before building, gateway stamps after decoding."""
    call = _method(ch, f"Emit_{kind}", Go, EMIT_TYPES[kind])()
    recv: dict[int, int] = {}
    for i in range(n):
        await call.write(Go(value=i))
        msg = await call.read()
        consume(msg)
        recv[i] = time.monotonic_ns()
    await call.done_writing()
    sent = (await _fetch_stamps(ch))[f"emit_{kind}"]
    return _latencies_ms(sent, recv, skip)


async def grpc_absorb(
    ch: grpc.aio.Channel, kind: str, build: Callable[[int], Any], n: int, skip: int
) -> list[float]:
    """Gateway -> stage: gateway stamps before building, stage stamps after decoding."""
    call = _method(ch, f"Absorb_{kind}", ABSORB_TYPES[kind], Go)()
    sent: dict[int, int] = {}
    for i in range(n):
        sent[i] = time.monotonic_ns()
        await call.write(build(i))
        await call.read()
    await call.done_writing()
    recv = (await _fetch_stamps(ch))[f"absorb_{kind}"]
    return _latencies_ms(sent, recv, skip)


async def grpc_relay(
    src: grpc.aio.Channel,
    dst: grpc.aio.Channel,
    emit_kind: str,
    absorb_kind: str,
    relay: Callable[[int, Any], Any],
    n: int,
    skip: int,
) -> list[float]:
    """Stage A -> gateway (copy, as pipeline.py) -> stage B: A's stamp to B's stamp."""
    a = _method(src, f"Emit_{emit_kind}", Go, EMIT_TYPES[emit_kind])()
    b = _method(dst, f"Absorb_{absorb_kind}", ABSORB_TYPES[absorb_kind], Go)()
    for i in range(n):
        await a.write(Go(value=i))
        msg = await a.read()
        await b.write(relay(i, msg))
        await b.read()
    await a.done_writing()
    await b.done_writing()
    sent = (await _fetch_stamps(src))[f"emit_{emit_kind}"]
    recv = (await _fetch_stamps(dst))[f"absorb_{absorb_kind}"]
    return _latencies_ms(sent, recv, skip)


async def in_process(obj_factory: Callable[[int], Any], n: int, skip: int) -> list[float]:
    """Two tasks of one process handing the ready object through an asyncio.Queue, paced by an ack."""
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    ack: asyncio.Queue[int] = asyncio.Queue()
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}

    async def consumer() -> None:
        for _ in range(n):
            seq, _obj = await q.get()
            recv[seq] = time.monotonic_ns()
            ack.put_nowait(seq)

    task = asyncio.create_task(consumer())
    for i in range(n):
        obj = obj_factory(i)
        sent[i] = time.monotonic_ns()
        q.put_nowait((i, obj))
        await ack.get()
    await task
    return _latencies_ms(sent, recv, skip)


@dataclass
class HopResult:
    hop: str
    message: str
    bytes: int
    grpc_ms: dict[str, float]
    in_process_ms: dict[str, float]
    added_p50_ms: float
    added_p99_ms: float
    meets_target: bool | None  # None for the two-hop relays (target is per hop)


def _result(
    hop: str, message: str, size: int, grpc_lat: list[float], local: list[float], per_hop: bool = True
) -> HopResult:
    g, loc = percentiles(grpc_lat), percentiles(local)
    added50, added99 = g["p50"] - loc["p50"], g["p99"] - loc["p99"]
    return HopResult(
        hop, message, size, g, loc, added50, added99, added50 <= TARGET_ADDED_P50_MS if per_hop else None
    )


async def run_all(args: argparse.Namespace, a: StageProc, b: StageProc, deadline: float) -> list[HopResult]:
    m = Messages(Payload(args.hidden_size), args.device)
    n, skip = args.iters + args.warmup, args.warmup
    results: list[HopResult] = []
    hidden_obj = m.hidden
    async with (
        grpc.aio.insecure_channel(a.addr, options=GRPC_OPTIONS) as ca,
        grpc.aio.insecure_channel(b.addr, options=GRPC_OPTIONS) as cb,
    ):
        plan: list[tuple[str, str, int, Callable[[], Any], Callable[[int], Any], bool]] = [
            (
                "thinker -> gateway",
                "ThinkerResponse(SpeechChunk)",
                m.speech(0).ByteSize(),
                lambda: grpc_emit(ca, "speech", lambda _msg: None, n, skip),
                lambda _i: hidden_obj,
                True,
            ),
            (
                "gateway -> talker",
                "TalkerRequest(TalkerChunk)",
                m.talker_chunk(0).ByteSize(),
                lambda: grpc_absorb(cb, "talker_chunk", m.talker_chunk, n, skip),
                lambda _i: hidden_obj,
                True,
            ),
            (
                "talker -> gateway",
                "TalkerResponse(CodecWindow)",
                m.window_out(0).ByteSize(),
                lambda: grpc_emit(ca, "window_out", m.consume_window, n, skip),
                lambda _i: m.codes,
                True,
            ),
            (
                "gateway -> code2wav",
                "Code2WavRequest(CodecWindow)",
                m.window_in(0).ByteSize(),
                lambda: grpc_absorb(cb, "window_in", m.window_in, n, skip),
                lambda _i: m.codes,
                True,
            ),
            (
                "code2wav -> gateway",
                "Code2WavResponse(AudioChunk)",
                m.audio(0).ByteSize(),
                lambda: grpc_emit(ca, "audio", m.consume_audio, n, skip),
                lambda _i: m.samples,
                True,
            ),
            (
                "thinker -> gateway -> talker (relay)",
                "SpeechChunk -> TalkerChunk",
                m.speech(0).ByteSize(),
                lambda: grpc_relay(
                    ca, cb, "speech", "talker_chunk", lambda i, msg: m.talker_chunk(i, msg.speech), n, skip
                ),
                lambda _i: hidden_obj,
                False,
            ),
            (
                "talker -> gateway -> code2wav (relay)",
                "CodecWindow -> CodecWindow",
                m.window_out(0).ByteSize(),
                lambda: grpc_relay(
                    ca, cb, "window_out", "window_in", lambda i, msg: m.window_in(i, msg.window), n, skip
                ),
                lambda _i: m.codes,
                False,
            ),
        ]
        for hop, message, size, grpc_fn, local_obj, per_hop in plan:
            if time.monotonic() >= deadline:
                print(f"[hops] out of time before '{hop}'", flush=True)
                break
            t0 = time.monotonic()
            grpc_lat = await grpc_fn()
            local = await in_process(local_obj, n, skip)
            r = _result(hop, message, size, grpc_lat, local, per_hop)
            results.append(r)
            print(
                f"[hops] {hop:40s} {size / 1024:7.1f} KiB  gRPC p50 {r.grpc_ms['p50'] * 1000:7.1f} us "
                f"p99 {r.grpc_ms['p99'] * 1000:7.1f} us  in-process p50 {r.in_process_ms['p50'] * 1000:6.1f} us"
                f"  ({time.monotonic() - t0:.1f} s)",
                flush=True,
            )
    return results


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## gRPC hop cost — {report['iters']} paced messages per hop after {report['warmup']} warm-up, "
        f"device {report['device']}, loopback TCP",
        "",
        "| hop | message | bytes | gRPC p50 / p90 / p99 ms | in-process p50 / p99 ms | added p50 / p99 ms | ≤ 1 ms p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["hops"]:
        g, loc = r["grpc_ms"], r["in_process_ms"]
        verdict = "—" if r["meets_target"] is None else ("yes" if r["meets_target"] else "**no**")
        lines.append(
            f"| {r['hop']} | {r['message']} | {r['bytes']} | {g['p50']:.3f} / {g['p90']:.3f} / {g['p99']:.3f} | "
            f"{loc['p50']:.4f} / {loc['p99']:.4f} | {r['added_p50_ms']:.3f} / {r['added_p99_ms']:.3f} | {verdict} |"
        )
    lines += [
        "",
        "Latency = producer stamp before building the message -> consumer stamp after decoding it "
        "(CLOCK_MONOTONIC across processes); relays are two hops plus the gateway's copy.",
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.hops", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=["run", "serve"], default="run", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="where stage-side tensors live (cuda adds D2H/H2D copies)")
    p.add_argument("--hidden-size", type=int, default=4096, help="thinker hidden width (MiniCPM-o 4.5: 4096)")
    p.add_argument("--iters", type=int, default=2000, help="timed messages per hop")
    p.add_argument("--warmup", type=int, default=200, help="untimed messages per hop first")
    p.add_argument("--max-seconds", type=float, default=300.0, help="no new hop starts after this")
    p.add_argument("--out-dir", default=None, help="default: $OUT/hops or ./bench-results/hops")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "serve":
        asyncio.run(serve(args))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[hops] --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.max_seconds
    out_dir = Path(args.out_dir or Path(os.environ.get("OUT", "bench-results")) / "hops")
    out_dir.mkdir(parents=True, exist_ok=True)
    stages: list[StageProc] = []
    try:
        stages = [StageProc("stage-a", args), StageProc("stage-b", args)]
        print(f"[hops] stage processes at {stages[0].addr} and {stages[1].addr}", flush=True)
        hops = asyncio.run(run_all(args, stages[0], stages[1], deadline))
    finally:
        for s in stages:
            s.stop()
    report = {
        "bench": "hops",
        "device": args.device,
        "hidden_size": args.hidden_size,
        "iters": args.iters,
        "warmup": args.warmup,
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
        "grpc_version": grpc.__version__,
        "hops": [r.__dict__ for r in hops],
    }
    (out_dir / "hops.json").write_text(json.dumps(report, indent=2))
    md = render_markdown(report)
    (out_dir / "hops.md").write_text(md)
    print(md, flush=True)
    print(f"[hops] wrote {out_dir / 'hops.json'} and {out_dir / 'hops.md'}", flush=True)
    return 0 if len(hops) == 7 else 1


if __name__ == "__main__":
    raise SystemExit(main())
