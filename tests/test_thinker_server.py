"""Thinker gRPC stage on loopback (tiny checkpoint, CPU): turn-mode stream contract, speech span export
with hidden rows, typed errors, interrupts, cancellation freeing KV, GetInfo/health."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_ARGUMENT,
    UNSUPPORTED_MEDIA,
)
from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.pcm import pcm_from_float
from services.common.tensors import tensor_from_proto
from services.thinker.backend import build_backend
from services.thinker.engine import EngineConfig
from services.thinker.server import make_server

torch.set_num_threads(1)
MAX_CONTEXT = 600


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(max_context=MAX_CONTEXT, kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def text_open(text: str, **kw: object) -> thinker_pb2.ThinkerOpen:
    msg = thinker_pb2.ChatMessage(role="user", content=[thinker_pb2.ContentPart(text=text)])
    ident = common_pb2.Identity(request_id="req-1", session_id="s-1", epoch=3, turn_id=1)
    return thinker_pb2.ThinkerOpen(id=ident, mode=common_pb2.STREAM_MODE_TURN, messages=[msg], **kw)


async def _with_server(backend, body) -> None:  # noqa: ANN001
    server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await body(thinker_pb2_grpc.ThinkerServiceStub(ch), ch)
    finally:
        await server.stop(grace=0.5)


async def _collect(stub, requests: list[thinker_pb2.ThinkerRequest]) -> list[thinker_pb2.ThinkerResponse]:  # noqa: ANN001
    async def gen() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
        for r in requests:
            yield r

    return [r async for r in stub.Generate(gen(), timeout=60)]


def test_turn_stream_text_and_speech_span(backend) -> None:  # noqa: ANN001
    sampling = thinker_pb2.SamplingParams(max_tokens=23)
    open_msg = text_open(
        "Say something.",
        sampling=sampling,
        want_speech=True,
        chunk_tokens=10,
        first_chunk_tokens=4,
        hidden_dtype=common_pb2.DTYPE_FLOAT32,
    )

    async def body(stub, ch) -> None:  # noqa: ANN001
        info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
        assert info.stage == "thinker" and info.limits["max_context"] == MAX_CONTEXT
        assert "duplex" in info.capabilities and info.properties["hidden_size"] == str(backend.hidden_size)
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        got = await _collect(stub, [thinker_pb2.ThinkerRequest(open=open_msg)])
        kinds = [r.WhichOneof("kind") for r in got]
        assert kinds[-1] == "done" and "error" not in kinds
        done = got[-1].done
        assert done.finish_reason == "length" and done.usage.completion_tokens == 23
        assert [r.text.id.chunk_seq for r in got if r.HasField("text")] == sorted(
            r.text.id.chunk_seq for r in got if r.HasField("text")
        )
        assert all(
            r.text.id.request_id == "req-1" and r.text.id.epoch == 3 for r in got if r.HasField("text")
        )
        text_ids = [t for r in got if r.HasField("text") for t in r.text.token_ids]
        assert len(text_ids) == 23
        speech = [r.speech for r in got if r.HasField("speech")]
        # Span = every generated token (the prompt ends with <|tts_bos|>), cut 4, 10, 9 (last).
        assert [len(c.token_ids) for c in speech] == [4, 10, 9]
        assert [c.is_last for c in speech] == [False, False, True]
        assert speech[0].turn_start and not speech[1].turn_start
        span_ids = [t for c in speech for t in c.token_ids]
        assert span_ids == text_ids
        rows = torch.cat([tensor_from_proto(c.hidden) for c in speech])
        assert rows.shape == (23, backend.hidden_size) and rows.dtype == torch.float32

        # Rows are the final-norm hidden states produced when each span token was the model input.
        from services.thinker.processor.chat import Message

        processed = backend.processor([Message("user", ["Say something."])], use_tts_template=True)
        prompt = processed.input_ids.tolist()
        assert prompt[-1] == 151703
        full = torch.tensor(prompt + span_ids)
        hidden, _ = backend.model.forward_hidden(backend.model.embed_tokens(full))
        assert torch.allclose(rows, hidden[len(prompt) :], atol=1e-4, rtol=1e-4)
        text = "".join(r.text.text for r in got if r.HasField("text"))
        assert text == backend.tokenizer.decode(text_ids, skip_special_tokens=True)

    asyncio.run(_with_server(backend, body))


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), 128, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_multimodal_prompt_and_typed_errors(backend) -> None:  # noqa: ANN001
    async def body(stub, ch) -> None:  # noqa: ANN001
        # Image + audio prompt goes through the encoders and generates.
        audio = pcm_from_float(np.sin(np.arange(16000) / 9.0).astype(np.float32) * 0.3, 16000)
        msg = thinker_pb2.ChatMessage(
            role="user",
            content=[
                thinker_pb2.ContentPart(image=thinker_pb2.ImagePart(data=_png())),
                thinker_pb2.ContentPart(audio=thinker_pb2.AudioPart(pcm=audio)),
                thinker_pb2.ContentPart(text="What is this?"),
            ],
        )
        open_mm = thinker_pb2.ThinkerOpen(messages=[msg], sampling=thinker_pb2.SamplingParams(max_tokens=3))
        got = await _collect(stub, [thinker_pb2.ThinkerRequest(open=open_mm)])
        assert got[-1].HasField("done") and got[-1].done.usage.completion_tokens == 3
        assert got[-1].done.usage.prompt_tokens > 64  # image + audio rows were expanded

        # A reference voice goes into the speech system prompt (audio rows in the prompt).
        plain = text_open("Hello.", want_speech=True, sampling=thinker_pb2.SamplingParams(max_tokens=2))
        voiced = text_open("Hello.", want_speech=True, sampling=thinker_pb2.SamplingParams(max_tokens=2))
        voiced.ref_audio.CopyFrom(audio)
        p_plain, p_voiced = [
            (await _collect(stub, [thinker_pb2.ThinkerRequest(open=o)]))[-1].done.usage.prompt_tokens
            for o in (plain, voiced)
        ]
        assert p_voiced >= p_plain + 10  # 1 s of reference audio = 10 rows + framing

        async def first_error(requests: list[thinker_pb2.ThinkerRequest]) -> common_pb2.Error:
            out = await _collect(stub, requests)
            assert out[-1].HasField("error"), out
            return out[-1].error

        err = await first_error([thinker_pb2.ThinkerRequest(unit=thinker_pb2.ThinkerUnit())])
        assert err.code == INVALID_ARGUMENT and err.param == "open"
        err = await first_error([thinker_pb2.ThinkerRequest(open=thinker_pb2.ThinkerOpen())])
        assert err.code == INVALID_ARGUMENT and err.param == "messages"
        bad_img = thinker_pb2.ChatMessage(
            role="user", content=[thinker_pb2.ContentPart(image=thinker_pb2.ImagePart(data=b"not an image"))]
        )
        err = await first_error(
            [thinker_pb2.ThinkerRequest(open=thinker_pb2.ThinkerOpen(messages=[bad_img]))]
        )
        assert err.code == UNSUPPORTED_MEDIA and err.param.startswith("messages[0].content[0]")
        err = await first_error([thinker_pb2.ThinkerRequest(open=text_open("word " * (MAX_CONTEXT + 10)))])
        assert err.code == CONTEXT_LENGTH_EXCEEDED and err.id.request_id == "req-1"
        bad_sampling = text_open("hi", sampling=thinker_pb2.SamplingParams(top_p=1.5))
        err = await first_error([thinker_pb2.ThinkerRequest(open=bad_sampling)])
        assert err.code == INVALID_ARGUMENT and err.param == "sampling.top_p"
        # NaN passes "< 0" and would stall the sequence on NaN probabilities: refused up front instead.
        for field in ("temperature", "repetition_penalty"):
            nan_sampling = text_open("hi", sampling=thinker_pb2.SamplingParams(**{field: float("nan")}))
            err = await first_error([thinker_pb2.ThinkerRequest(open=nan_sampling)])
            assert err.code == INVALID_ARGUMENT and err.param == f"sampling.{field}"
        # ...and the stream after it is served normally.
        got = await _collect(
            stub,
            [
                thinker_pb2.ThinkerRequest(
                    open=text_open("hi", sampling=thinker_pb2.SamplingParams(max_tokens=2))
                )
            ],
        )
        assert got[-1].HasField("done")

    asyncio.run(_with_server(backend, body))


def test_interrupt_and_cancel_free_kv(backend) -> None:  # noqa: ANN001
    engine = backend.engine
    long_open = text_open(
        "Tell a long story.", sampling=thinker_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    )

    async def body(stub, ch) -> None:  # noqa: ANN001
        # Interrupt: ack with the new epoch, then Done("interrupted").
        queue: asyncio.Queue[thinker_pb2.ThinkerRequest | None] = asyncio.Queue()
        queue.put_nowait(thinker_pb2.ThinkerRequest(open=long_open))

        async def gen() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
            while (item := await queue.get()) is not None:
                yield item

        call = stub.Generate(gen(), timeout=60)
        got: list[thinker_pb2.ThinkerResponse] = []
        async for resp in call:
            got.append(resp)
            if len(got) == 3:
                ctl = common_pb2.Control(interrupt=common_pb2.Interrupt(new_epoch=4, reason="barge-in"))
                queue.put_nowait(thinker_pb2.ThinkerRequest(control=ctl))
        queue.put_nowait(None)
        kinds = [r.WhichOneof("kind") for r in got]
        assert "interrupt_ack" in kinds and kinds[-1] == "done"
        assert got[kinds.index("interrupt_ack")].interrupt_ack.new_epoch == 4
        assert got[-1].done.finish_reason == "interrupted"
        assert got[-1].done.usage.completion_tokens < 400
        await _wait_kv_zero(engine)

        # Client cancel mid-stream: the sequence is closed and its KV freed.
        call = stub.Generate(_one(long_open), timeout=60)
        n = 0
        async for _ in call:
            n += 1
            if n == 5:
                assert engine.kv_used_bytes > 0
                call.cancel()
                break
        await _wait_kv_zero(engine)

        # Deadline: the server side sees the stream cancelled and frees the KV too.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stub.Generate(_one(long_open), timeout=0.5):
                pass
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _wait_kv_zero(engine)

    asyncio.run(_with_server(backend, body))


async def _one(open_msg: thinker_pb2.ThinkerOpen) -> AsyncIterator[thinker_pb2.ThinkerRequest]:
    yield thinker_pb2.ThinkerRequest(open=open_msg)
    await asyncio.sleep(3600)  # keep the request side open, like a real client


async def _wait_kv_zero(engine, timeout: float = 5.0) -> None:  # noqa: ANN001
    from prometheus_client import REGISTRY

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        in_flight = REGISTRY.get_sample_value("minicpmo_stage_in_flight", {"stage": "thinker"})
        if engine.kv_used_bytes == 0 and engine.is_idle() and in_flight == 0:
            assert REGISTRY.get_sample_value("minicpmo_thinker_kv_used_bytes") == 0
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"KV not freed: {engine.kv_used_bytes} bytes still allocated")


def test_graceful_drain_finishes_open_streams_and_refuses_new(backend) -> None:  # noqa: ANN001
    from services.common.errors import UNAVAILABLE

    async def run() -> None:
        server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
        port = await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = thinker_pb2_grpc.ThinkerServiceStub(ch)
            open_msg = text_open(
                "Go on.", sampling=thinker_pb2.SamplingParams(max_tokens=40, ignore_eos=True)
            )
            call = stub.Generate(_one(open_msg), timeout=60)
            it = call.__aiter__()
            first = await it.__anext__()
            assert first.HasField("text")
            stopping = asyncio.create_task(server.stop(grace=2.0))  # what SIGTERM triggers
            while not server.servicer.draining:
                await asyncio.sleep(0.01)
            refused = await _collect(stub, [thinker_pb2.ThinkerRequest(open=text_open("hi"))])
            assert refused[-1].error.code == UNAVAILABLE
            rest = [r async for r in it]
            assert rest[-1].HasField("done") and rest[-1].done.finish_reason == "length"
            assert rest[-1].done.usage.completion_tokens == 40
            await stopping
        await _wait_kv_zero(backend.engine)

    asyncio.run(run())


def test_concurrent_streams_batch_and_match_solo_runs(backend) -> None:  # noqa: ANN001
    """Four streams at once share engine steps (continuous batching) and give their solo greedy tokens."""
    texts = ["one", "two words here", "a somewhat longer third prompt", "4"]

    async def body(stub, ch) -> None:  # noqa: ANN001
        def open_req(text: str) -> list[thinker_pb2.ThinkerRequest]:
            return [
                thinker_pb2.ThinkerRequest(
                    open=text_open(text, sampling=thinker_pb2.SamplingParams(max_tokens=8))
                )
            ]

        def ids(resps: list[thinker_pb2.ThinkerResponse]) -> list[int]:
            return [t for r in resps if r.HasField("text") for t in r.text.token_ids]

        solo = [ids(await _collect(stub, open_req(t))) for t in texts]
        from services.common.metrics import BATCH_SIZE

        rows_before = BATCH_SIZE.labels("thinker")._sum.get()
        steps_before = sum(b.get() for b in BATCH_SIZE.labels("thinker")._buckets)
        together = await asyncio.gather(*(_collect(stub, open_req(t)) for t in texts))
        rows = BATCH_SIZE.labels("thinker")._sum.get() - rows_before
        steps = sum(b.get() for b in BATCH_SIZE.labels("thinker")._buckets) - steps_before
        assert [ids(r) for r in together] == solo
        assert rows / steps > 1.5  # steps carried several streams at once

    asyncio.run(_with_server(backend, body))
