"""Code2wav voice registry RPC (tiny checkpoint, CPU): ``EncodeVoice`` returns the prompt features of a
clip once; an open carrying them (``Code2WavOpen.voice``) sounds exactly like one carrying the clip, and
bad clips / mismatched features are typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_code2wav_server import CODES, _args, _window

from services.code2wav.engine import STORED_VOICE_HITS, STORED_VOICE_LOADS
from services.code2wav.runner import ORIGIN_SETUPS
from services.common.checkpoint import CODEC_SILENCE_ID
from services.common.errors import BAD_REFERENCE_AUDIO
from services.common.grpc_server import ServeOptions, StageServer
from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2
from services.common.pcm import pcm_from_float


def _clip(seconds: float = 2.5, rate: int = 22050) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.2 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


async def _pcm(stub, open_msg: code2wav_pb2.Code2WavOpen) -> bytes:  # noqa: ANN001
    first = [CODEC_SILENCE_ID] * 3 + CODES[:25]

    async def gen() -> AsyncIterator[code2wav_pb2.Code2WavRequest]:
        yield code2wav_pb2.Code2WavRequest(open=open_msg)
        yield _window(0, first, True)

    out = b""
    async for r in stub.Generate(gen()):
        if r.HasField("error"):
            raise AssertionError(r.error)
        if r.HasField("audio"):
            out += r.audio.pcm.data
    return out


def test_encode_voice_once_then_open_with_features(tiny_ckpt: Path) -> None:
    from services.code2wav.server import SERVICE_FULL_NAME, Code2WavServicer, add_servicer, stage_info
    from services.code2wav.service import build_engine

    async def scenario() -> None:
        engine, _ = build_engine(_args(tiny_ckpt))
        await engine.start()
        servicer = Code2WavServicer(engine, stage_info(engine, "4.5"))
        options = ServeOptions(host="127.0.0.1", port=0, metrics_port=0)
        server = StageServer("code2wav", SERVICE_FULL_NAME, add_servicer(servicer), options)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = code2wav_pb2_grpc.Code2WavServiceStub(channel)
                ref = pcm_from_float(_clip(), 22050)
                voice = await stub.EncodeVoice(code2wav_pb2.Code2WavVoiceRequest(ref_audio=ref))
                assert list(voice.tokens.shape) == [1, 150] and list(voice.mel.shape) == [1, 300, 80]
                assert voice.spk_emb.shape[0] == 1 and voice.digest
                # Stored bytes round-trip (the gateway writes the message to disk as is).
                voice = code2wav_pb2.VoicePrompt.FromString(voice.SerializeToString())

                misses = engine.voices.misses
                loads, hits = STORED_VOICE_LOADS._value.get(), STORED_VOICE_HITS._value.get()
                setups = ORIGIN_SETUPS._value.get()
                ident = common_pb2.Identity(request_id="v")
                with_voice = await _pcm(stub, code2wav_pb2.Code2WavOpen(id=ident, seed=3, voice=voice))
                again = await _pcm(stub, code2wav_pb2.Code2WavOpen(id=ident, seed=3, voice=voice))
                assert engine.voices.misses == misses  # nothing featurised for the stored voice
                # Loaded onto the device and set up (flow prompt) by the first stream only.
                assert STORED_VOICE_LOADS._value.get() == loads + 1
                assert STORED_VOICE_HITS._value.get() == hits + 1
                assert ORIGIN_SETUPS._value.get() == setups + 1
                assert again == with_voice
                with_clip = await _pcm(stub, code2wav_pb2.Code2WavOpen(id=ident, seed=3, ref_audio=ref))
                default = await _pcm(stub, code2wav_pb2.Code2WavOpen(id=ident, seed=3))
                assert with_voice == with_clip and with_voice != default

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    short = pcm_from_float(_clip(0.5), 22050)
                    await stub.EncodeVoice(code2wav_pb2.Code2WavVoiceRequest(ref_audio=short))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                bad = code2wav_pb2.VoicePrompt()
                bad.CopyFrom(voice)
                bad.mel.shape[1] = 150
                bad.mel.data = bad.mel.data[: len(bad.mel.data) // 2]

                async def gen() -> AsyncIterator[code2wav_pb2.Code2WavRequest]:
                    yield code2wav_pb2.Code2WavRequest(open=code2wav_pb2.Code2WavOpen(id=ident, voice=bad))

                replies = [r async for r in stub.Generate(gen())]
                assert replies[-1].error.code == BAD_REFERENCE_AUDIO
        finally:
            await server.stop(grace=0.5)
            await engine.stop()

    asyncio.run(scenario())
