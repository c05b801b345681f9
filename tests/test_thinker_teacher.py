"""Thinker teacher-forced speech (``ThinkerOpen.teacher_text``, tiny checkpoint, CPU): the spoken span is
exactly the given text, its rows are the final-norm hidden states of the prompt + forced tokens (the
rows a sampled reply would carry), chunked as a spoken reply is, across chunked prefill steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import INVALID_ARGUMENT
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.pcm import pcm_from_float
from services.common.tensors import tensor_from_proto
from services.thinker.backend import build_backend
from services.thinker.engine import EngineConfig
from services.thinker.voice import REFERENCE_ENCODES, VOICE_PREFIX_BUILDS, VOICE_PREFIX_HITS

torch.set_num_threads(1)
TEXT = "Hello there. This is a test of reading text aloud, exactly as written!"


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    # A small step budget, so the prompt and the forced tokens are prefilled over several steps.
    cfg = EngineConfig(max_context=600, kv_budget_bytes=16 << 20, max_step_tokens=16)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


async def _run(backend, open_msg: thinker_pb2.ThinkerOpen) -> list[thinker_pb2.ThinkerResponse]:  # noqa: ANN001
    import grpc

    from services.common.grpc_server import ServeOptions
    from services.thinker.server import make_server

    server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = thinker_pb2_grpc.ThinkerServiceStub(ch)

            async def gen():  # noqa: ANN202
                yield thinker_pb2.ThinkerRequest(open=open_msg)

            return [r async for r in stub.Generate(gen(), timeout=60)]
    finally:
        await server.stop(grace=0.5)


def _open(parts: list[thinker_pb2.ContentPart], **kw: object) -> thinker_pb2.ThinkerOpen:
    msg = thinker_pb2.ChatMessage(role="user", content=parts)
    return thinker_pb2.ThinkerOpen(
        id=common_pb2.Identity(request_id="tts-1"),
        mode=common_pb2.STREAM_MODE_TURN,
        messages=[msg],
        teacher_text=TEXT,
        chunk_tokens=5,
        first_chunk_tokens=3,
        hidden_dtype=common_pb2.DTYPE_FLOAT32,
        **kw,
    )


@pytest.mark.parametrize("with_audio", [False, True])
def test_teacher_forced_span_is_the_text_with_prefill_rows(backend, with_audio: bool) -> None:  # noqa: ANN001
    parts = [thinker_pb2.ContentPart(text="Please read the text below.")]
    audio = None
    if with_audio:  # an audio part makes the prompt carry encoder rows (the embeds path)
        audio = (0.1 * np.sin(np.linspace(0, 600, 16000))).astype(np.float32)
        parts.append(thinker_pb2.ContentPart(audio=thinker_pb2.AudioPart(pcm=pcm_from_float(audio, 16000))))
    parts.append(thinker_pb2.ContentPart(text=TEXT))
    got = asyncio.run(_run(backend, _open(parts)))
    kinds = [r.WhichOneof("kind") for r in got]
    assert "error" not in kinds and kinds[-1] == "done"
    forced = backend.tokenizer.encode(TEXT, add_special_tokens=False)
    speech = [r.speech for r in got if r.HasField("speech")]
    ids = [t for c in speech for t in c.token_ids]
    assert ids == forced
    assert [len(c.token_ids) for c in speech[:2]] == [3, 5] and speech[-1].is_last
    assert sum(1 for c in speech if c.is_last) == 1
    text = "".join(r.text.text for r in got if r.HasField("text"))
    assert text == TEXT
    done = got[-1].done
    assert done.finish_reason == "stop" and done.usage.completion_tokens == len(forced)

    from services.thinker.processor import AudioClip, AudioInput
    from services.thinker.processor.chat import Message

    msg_parts: list[object] = ["Please read the text below."]
    if audio is not None:
        msg_parts.append(AudioInput(AudioClip(audio, 16000)))
    msg_parts.append(TEXT)
    processed = backend.processor([Message("user", msg_parts)], use_tts_template=True)
    prompt = processed.input_ids.tolist()
    assert prompt[-1] == 151703 and done.usage.prompt_tokens == len(prompt)
    embeds = backend.model.embed_prompt(processed)
    full = torch.cat([embeds, backend.model.embed_tokens(torch.tensor(forced))])
    hidden, _ = backend.model.forward_hidden(full)
    rows = torch.cat([tensor_from_proto(c.hidden) for c in speech])
    assert torch.allclose(rows, hidden[len(prompt) :], atol=2e-3, rtol=1e-3)  # chunked vs one pass


def test_registered_voice_rows_stand_in_for_the_clip(backend) -> None:  # noqa: ANN001
    """EncodeVoice's rows in ThinkerOpen.voice give the prompt and spoken rows a ref_audio gives."""
    rate = 22050
    t = np.arange(int(2.5 * rate)) / rate
    clip = (0.2 * np.sin(2 * np.pi * 170 * t) * (1 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    ref = pcm_from_float(clip, rate)
    parts = [thinker_pb2.ContentPart(text="Please read the text below."), thinker_pb2.ContentPart(text=TEXT)]

    async def scenario() -> tuple[thinker_pb2.VoiceEmbedding, list, list]:  # noqa: ANN001
        import grpc

        from services.common.grpc_server import ServeOptions
        from services.thinker.server import make_server

        server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = thinker_pb2_grpc.ThinkerServiceStub(ch)
                voice = await stub.EncodeVoice(thinker_pb2.ThinkerVoiceRequest(ref_audio=ref), timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.EncodeVoice(thinker_pb2.ThinkerVoiceRequest(), timeout=60)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                async def run(open_msg: thinker_pb2.ThinkerOpen) -> list:
                    async def gen():  # noqa: ANN202
                        yield thinker_pb2.ThinkerRequest(open=open_msg)

                    return [r async for r in stub.Generate(gen(), timeout=60)]

                with_clip = await run(_open(parts, ref_audio=ref))
                builds, hits = VOICE_PREFIX_BUILDS._value.get(), VOICE_PREFIX_HITS._value.get()
                encodes = REFERENCE_ENCODES._value.get()
                with_rows = await run(_open(parts, voice=voice))
                again = await run(_open(parts, voice=voice))
                # The voice's prefix was derived by the first request only, and no clip was encoded.
                assert VOICE_PREFIX_BUILDS._value.get() == builds + 1
                assert VOICE_PREFIX_HITS._value.get() == hits + 1
                assert REFERENCE_ENCODES._value.get() == encodes
                assert [r.speech.hidden.data for r in again if r.HasField("speech")] == [
                    r.speech.hidden.data for r in with_rows if r.HasField("speech")
                ]
                # The second request's prompt found the voice's prefix blocks in the prefix cache.
                assert again[-1].done.usage.cached_tokens >= backend.engine.layout.block_size
                both = await run(_open(parts, voice=voice, ref_audio=ref))
                assert both[-1].error.code == INVALID_ARGUMENT and both[-1].error.param == "voice"
                return voice, with_clip, with_rows
        finally:
            await server.stop(grace=0.5)

    voice, with_clip, with_rows = asyncio.run(scenario())
    rows = tensor_from_proto(voice.embeds)
    assert rows.shape == (25, backend.hidden_size)  # 2.5 s at 10 rows per second
    assert with_clip[-1].done.usage.prompt_tokens == with_rows[-1].done.usage.prompt_tokens
    clip_rows = torch.cat([tensor_from_proto(r.speech.hidden) for r in with_clip if r.HasField("speech")])
    voice_rows = torch.cat([tensor_from_proto(r.speech.hidden) for r in with_rows if r.HasField("speech")])
    assert torch.allclose(clip_rows, voice_rows, atol=2e-3, rtol=1e-3)


def test_a_duplex_session_takes_the_stored_rows_as_its_voice(backend) -> None:  # noqa: ANN001
    """A duplex open with ``voice`` builds the prefix an inline 16 kHz ``ref_audio`` of the same clip
    builds, from the stored rows, without encoding the clip."""
    from services.thinker.duplex import DuplexSession
    from services.thinker.voice import encode_voice

    t = np.arange(int(2.0 * 16000)) / 16000
    clip = (0.2 * np.sin(2 * np.pi * 190 * t) * (1 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    ref = pcm_from_float(clip, 16000)
    voice = encode_voice(backend, thinker_pb2.ThinkerVoiceRequest(ref_audio=ref))

    def prefix(**kw: object):  # noqa: ANN202
        open_msg = thinker_pb2.ThinkerOpen(
            id=common_pb2.Identity(session_id="s"),
            mode=common_pb2.STREAM_MODE_DUPLEX,
            want_speech=True,
            instructions="Talk.",
            **kw,
        )
        return DuplexSession(backend, open_msg).prefix_work()

    from_clip = prefix(ref_audio=ref)
    encodes = REFERENCE_ENCODES._value.get()
    from_rows = prefix(voice=voice)
    assert REFERENCE_ENCODES._value.get() == encodes  # the stored rows, no encoder pass
    assert from_rows.token_ids == from_clip.token_ids
    assert from_rows.embeds is not None and from_clip.embeds is not None
    assert torch.allclose(from_rows.embeds, from_clip.embeds, atol=1e-5)
    assert from_rows.media and from_rows.media[0].end - from_rows.media[0].start == 20  # 10 rows per second
