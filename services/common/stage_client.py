"""``minicpmo-stage-client``: send one request to one stage and print or save what comes back.

This is the stage-level test client of the design card: it talks to a single stage service directly,
without the gateway, so each stage can be exercised (and debugged) on its own.

Examples::

    minicpmo-stage-client thinker --addr localhost:50051 --prompt "Hello" --speech
    minicpmo-stage-client talker --addr localhost:50052 --tokens 40 --save-codes codes.json
    minicpmo-stage-client code2wav --addr localhost:50053 --codes-file codes.json --out reply.wav
    minicpmo-stage-client info --addr localhost:50052
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf import text_format

from services.common.audio import read_audio, write_wav
from services.common.grpc_server import GRPC_OPTIONS
from services.common.pb import (
    code2wav_pb2,
    code2wav_pb2_grpc,
    common_pb2,
    talker_pb2,
    talker_pb2_grpc,
    thinker_pb2,
    thinker_pb2_grpc,
)
from services.common.pcm import pcm_from_float, pcm_to_float
from services.common.tensors import tensor_to_proto

_STUBS: dict[str, type[Any]] = {  # the generated stub classes share no base class
    "thinker": thinker_pb2_grpc.ThinkerServiceStub,
    "talker": talker_pb2_grpc.TalkerServiceStub,
    "code2wav": code2wav_pb2_grpc.Code2WavServiceStub,
}


def _identity(args: argparse.Namespace) -> common_pb2.Identity:
    return common_pb2.Identity(
        request_id=args.request_id or f"cli-{uuid.uuid4().hex[:8]}", epoch=0, turn_id=0
    )


def _read_audio(path: str) -> common_pb2.Pcm:
    return pcm_from_float(*read_audio(path))


def _describe(msg: Any) -> str:
    """One line per response message; tensors and audio are summarised, not dumped."""
    kind = msg.WhichOneof("kind")
    body = getattr(msg, kind)
    ident = body.id if hasattr(body, "id") else None
    tag = f"[{kind} seq={ident.chunk_seq} epoch={ident.epoch}]" if ident is not None else f"[{kind}]"
    if kind == "text":
        return f"{tag} {body.text!r} ids={list(body.token_ids)}"
    if kind == "speech":
        shape = list(body.hidden.shape)
        return f"{tag} tokens={list(body.token_ids)} hidden={shape} text={body.text!r} last={body.is_last}"
    if kind == "unit":
        return f"{tag} decision={body.decision} transcript={body.transcript!r}"
    if kind == "window":
        return f"{tag} codes={len(body.codes)} left_context={body.left_context} last={body.is_last}"
    if kind == "audio":
        return f"{tag} samples={len(body.pcm.data) // 2} sr={body.pcm.sample_rate} last={body.is_last}"
    if kind == "done":
        return f"{tag} finish_reason={body.finish_reason} usage={{{text_format.MessageToString(body.usage, as_one_line=True)}}}"
    if kind == "error":
        return f"{tag} code={common_pb2.ErrorCode.Name(body.code)} param={body.param!r} {body.message}"
    return f"{tag} {body}"


async def _thinker_requests(args: argparse.Namespace) -> AsyncIterator[thinker_pb2.ThinkerRequest]:
    parts = [thinker_pb2.ContentPart(text=args.prompt)]
    if args.image:
        parts.insert(
            0, thinker_pb2.ContentPart(image=thinker_pb2.ImagePart(data=Path(args.image).read_bytes()))
        )
    if args.audio:
        parts.insert(0, thinker_pb2.ContentPart(audio=thinker_pb2.AudioPart(pcm=_read_audio(args.audio))))
    sampling = thinker_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    open_msg = thinker_pb2.ThinkerOpen(
        id=_identity(args),
        mode=common_pb2.STREAM_MODE_TURN,
        messages=[thinker_pb2.ChatMessage(role="user", content=parts)],
        sampling=sampling,
        use_tts_template=args.speech,
        want_speech=args.speech,
        hidden_dtype=common_pb2.DTYPE_FLOAT32,
    )
    yield thinker_pb2.ThinkerRequest(open=open_msg)


async def _talker_requests(
    args: argparse.Namespace, hidden_size: int
) -> AsyncIterator[talker_pb2.TalkerRequest]:
    ident = _identity(args)
    sampling = talker_pb2.TalkerSampling(seed=args.seed)
    if args.frames:
        sampling.fixed_frames = args.frames
    yield talker_pb2.TalkerRequest(
        open=talker_pb2.TalkerOpen(id=ident, mode=common_pb2.STREAM_MODE_TURN, sampling=sampling)
    )
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1000, 100000, (args.tokens,), generator=gen).tolist()
    hidden = torch.randn(args.tokens, hidden_size, generator=gen)
    step = 10
    for i in range(0, args.tokens, step):
        chunk_id = common_pb2.Identity()
        chunk_id.CopyFrom(ident)
        chunk_id.chunk_seq = i // step
        yield talker_pb2.TalkerRequest(
            chunk=talker_pb2.TalkerChunk(
                id=chunk_id,
                token_ids=ids[i : i + step],
                hidden=tensor_to_proto(hidden[i : i + step]),
                is_last=i + step >= args.tokens,
            )
        )


async def _code2wav_requests(args: argparse.Namespace) -> AsyncIterator[code2wav_pb2.Code2WavRequest]:
    ident = _identity(args)
    open_msg = code2wav_pb2.Code2WavOpen(id=ident, seed=args.seed)
    if args.ref_audio:
        open_msg.ref_audio.CopyFrom(_read_audio(args.ref_audio))
    yield code2wav_pb2.Code2WavRequest(open=open_msg)
    if args.codes_file:
        codes = [int(c) for c in json.loads(Path(args.codes_file).read_text())]
    else:
        rng = np.random.default_rng(args.seed)
        codes = rng.integers(0, 6561, size=args.num_codes).tolist()
    # Talker framing: 3 frames of left context (silence 4218 before the first window) + 25 new.
    history = [4218] * 3
    seq = 0
    for start in range(0, len(codes), 25):
        new = codes[start : start + 25]
        win_id = common_pb2.Identity()
        win_id.CopyFrom(ident)
        win_id.chunk_seq = seq
        window = common_pb2.CodecWindow(
            id=win_id, codes=history[-3:] + new, left_context=3, is_last=start + 25 >= len(codes)
        )
        history.extend(new)
        seq += 1
        yield code2wav_pb2.Code2WavRequest(window=window)


async def _run(args: argparse.Namespace) -> int:
    stage = args.stage if args.stage != "info" else None
    async with grpc.aio.insecure_channel(args.addr, options=GRPC_OPTIONS) as channel:
        if stage is None:
            for name, stub_cls in _STUBS.items():
                try:
                    info = await stub_cls(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=args.timeout)
                except grpc.aio.AioRpcError:
                    continue
                print(f"{name}: {info}")
                return 0
            print(f"no MiniCPM-o stage answered GetInfo at {args.addr}", file=sys.stderr)
            return 1
        stub = _STUBS[stage](channel)
        info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=args.timeout)
        if stage == "thinker":
            requests = _thinker_requests(args)
        elif stage == "talker":
            hidden = args.hidden_size or int(info.properties.get("condition_hidden_size", "0"))
            if hidden <= 0:
                print(
                    "talker GetInfo did not report condition_hidden_size; pass --hidden-size", file=sys.stderr
                )
                return 1
            requests = _talker_requests(args, hidden)
        else:
            requests = _code2wav_requests(args)
        t0 = time.perf_counter()
        audio: list[np.ndarray] = []
        codes: list[int] = []
        failed = False
        async for resp in stub.Generate(requests, timeout=args.timeout):
            print(f"{(time.perf_counter() - t0) * 1000:8.1f} ms {_describe(resp)}", flush=True)
            kind = resp.WhichOneof("kind")
            if kind == "audio":
                audio.append(pcm_to_float(resp.audio.pcm)[0])
            elif kind == "window":
                codes.extend(resp.window.codes[resp.window.left_context :])
            elif kind == "error":
                failed = True
        if audio and args.out:
            write_wav(args.out, np.concatenate(audio), 24000)
            print(f"wrote {args.out}")
        if codes and args.save_codes:
            Path(args.save_codes).write_text(json.dumps(codes))
            print(f"wrote {len(codes)} codes to {args.save_codes}")
        return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minicpmo-stage-client", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["thinker", "talker", "code2wav", "info"])
    p.add_argument("--addr", required=True, help="host:port of the stage")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    p.add_argument("--request-id", default="")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("thinker")
    g.add_argument("--prompt", default="Hello! Who are you?")
    g.add_argument("--image", help="image file to put before the prompt")
    g.add_argument("--audio", help="audio file to put before the prompt")
    g.add_argument("--speech", action="store_true", help="ask for the spoken span with hidden states")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g = p.add_argument_group("talker")
    g.add_argument("--tokens", type=int, default=20, help="random condition tokens to send")
    g.add_argument("--hidden-size", type=int, default=0, help="thinker hidden width (default: from GetInfo)")
    g.add_argument("--frames", type=int, default=0, help="fixed number of codec frames (0: model decides)")
    g.add_argument("--save-codes", help="write the generated codec ids as JSON")
    g = p.add_argument_group("code2wav")
    g.add_argument("--codes-file", help="JSON list of codec ids (default: random)")
    g.add_argument("--num-codes", type=int, default=53)
    g.add_argument("--ref-audio", help="reference voice file (default: the checkpoint's voice)")
    g.add_argument("--out", default="", help="WAV file for the received audio")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(asyncio.run(_run(args)))


if __name__ == "__main__":
    main()
