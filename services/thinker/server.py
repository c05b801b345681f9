"""Thin gRPC front of the Thinker: proto messages ⇄ engine work items and events.

``ThinkerService.Generate`` is one bidirectional stream per chat request (turn mode) or per duplex
session (``ThinkerOpen.mode``):

* turn: ``ThinkerOpen`` (messages, sampling, template switches, speech export settings) → ``TextDelta``
  per token, ``SpeechChunk`` (spoken span ids + hidden rows) and one ``Done``; a ``Control.interrupt``
  cancels the request (``InterruptAck`` then ``Done(interrupted)``);
* duplex: see :mod:`services.thinker.duplex` (``ThinkerUnit`` in, ``UnitResult`` + ``SpeechChunk`` out).

Errors are typed ``Error`` messages. Closing the stream (client gone, cancel, deadline) closes the
engine sequence, which frees its KV on the next engine iteration. The engine runs in its own thread;
its events cross back through ``loop.call_soon_threadsafe`` into a per-stream asyncio queue.
Health, reflection, metrics and graceful drain come from :mod:`services.common.grpc_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from services.common.checkpoint import Checkpoint
from services.common.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    StageError,
)
from services.common.grpc_server import (
    ServeOptions,
    StageServer,
    add_serve_arguments,
    serve_forever,
    serve_options_from_args,
)
from services.common.metrics import ERRORS, INTERRUPTS, REQUESTS, STREAMS_ACTIVE
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.stage_settings import (
    add_memory_fraction_argument,
    apply_memory_cap,
    parse_stage_args,
)
from services.common.tensors import (
    TORCH_DTYPES,
    compute_dtype,
    dtype_from_proto,
    dtype_to_proto,
    pcm_to_float,
)
from services.thinker.duplex_window import DuplexWindow
from services.thinker.engine import STAGE, EngineConfig, EngineEvent, ThinkerEngine
from services.thinker.errors import failure
from services.thinker.kv_cache import KVBudgetError
from services.thinker.sampling import DEFAULT_STOP_IDS, Sampler, SamplingConfig
from services.thinker.scheduler import WorkItem
from services.thinker.turn import TTS_BOS_ID, TurnOutput

log = logging.getLogger(__name__)

SERVICE_NAME = "minicpmo.v1.ThinkerService"
PROTOCOL_VERSION = "minicpmo.v1"
DEFAULT_MAX_TOKENS = 2048
DEFAULT_CHUNK_TOKENS = 10


@dataclass
class ThinkerBackend:
    """Everything a stream needs: the engine, the full model (encoders), the processor, the tokenizer."""

    engine: ThinkerEngine
    model: Any  # services.thinker.model.ThinkerModel
    processor: Any  # services.thinker.processor.ThinkerProcessor
    ckpt: Checkpoint
    device: str
    executor: ThreadPoolExecutor
    duplex_window: DuplexWindow | None = None  # None: a duplex session ends at the context limit

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def hidden_size(self) -> int:
        return self.engine.hidden_size


def build_backend(
    checkpoint: str, device: str, dtype: str | None, engine_config: EngineConfig
) -> ThinkerBackend:
    from services.thinker.model import ThinkerModel
    from services.thinker.processor import ThinkerProcessor

    ckpt = Checkpoint(checkpoint)
    model = ThinkerModel.from_checkpoint(ckpt, dtype=compute_dtype(dtype, device), device=device)
    processor = ThinkerProcessor.from_checkpoint(ckpt)
    if engine_config.kv_budget_bytes is None and not engine_config.reserve_bytes:
        # Every running sequence may be a duplex session with its own Whisper cache (plus two waiting).
        engine_config.reserve_bytes = (engine_config.max_num_seqs + 2) * model.audio_stream_bytes()
    engine = ThinkerEngine(model.llm, engine_config, device)
    return ThinkerBackend(engine, model, processor, ckpt, device, ThreadPoolExecutor(2, "thinker-encode"))


# ------------------------------------------------------------------------------------ proto → engine
def sampling_from_proto(msg: thinker_pb2.SamplingParams, room: int) -> SamplingConfig:
    """Proto sampling → validated config; unset fields mean greedy, 2048 tokens, default stop ids.

    ``room`` = context positions left after the prompt; ``max_tokens`` is capped to it so a request
    never reserves KV beyond the context limit.
    """
    if room < 1:
        raise StageError(
            CONTEXT_LENGTH_EXCEEDED, "the prompt leaves no room in the thinker context", "messages"
        )
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if msg.HasField("max_tokens") and max_tokens < 1:
        raise StageError(INVALID_ARGUMENT, "max_tokens must be >= 1", "sampling.max_tokens")
    cfg = SamplingConfig(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_tokens=min(int(max_tokens), room),
        min_tokens=min(int(msg.min_tokens) if msg.HasField("min_tokens") else 0, room),
        ignore_eos=bool(msg.ignore_eos),
        stop_token_ids=tuple(dict.fromkeys([*DEFAULT_STOP_IDS, *msg.stop_token_ids])),
    )
    return cfg.validate()


def messages_from_proto(backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> list[Any]:
    """Proto chat messages → processor messages (media stay encoded; the processor decodes them)."""
    from services.thinker.processor import AudioClip, AudioInput, ImageInput, Message, VideoInput
    from services.thinker.processor.chat import speech_system_message

    out: list[Any] = []
    if open_msg.want_speech and open_msg.ref_audio.data:
        samples, rate = pcm_to_float(open_msg.ref_audio)
        out.append(speech_system_message(AudioClip(samples, rate)))
    for i, m in enumerate(open_msg.messages):
        parts: list[Any] = []
        for j, part in enumerate(m.content):
            kind = part.WhichOneof("kind")
            if kind == "text":
                parts.append(part.text)
            elif kind == "image":
                parts.append(ImageInput(bytes(part.image.data)))
            elif kind == "audio":
                samples, rate = pcm_to_float(part.audio.pcm)
                parts.append(AudioInput(AudioClip(samples, rate)))
            elif kind == "video":
                parts.append(VideoInput(frames=tuple(bytes(f) for f in part.video.frames)))
                if part.video.soundtrack.data:
                    samples, rate = pcm_to_float(part.video.soundtrack)
                    parts.append(AudioInput(AudioClip(samples, rate)))
            else:
                raise StageError(INVALID_ARGUMENT, "empty content part", f"messages[{i}].content[{j}]")
        out.append(Message(m.role, parts))
    return out


@dataclass
class TurnPrompt:
    ids: list[int]
    embeds: torch.Tensor | None


def build_turn_prompt(backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> TurnPrompt:
    """Chat template + placeholder expansion + encoders (runs in a worker thread: encoders block)."""
    if not open_msg.messages:
        raise StageError(INVALID_ARGUMENT, "messages must not be empty", "messages")
    messages = messages_from_proto(backend, open_msg)
    use_tts = True if (open_msg.use_tts_template or open_msg.want_speech) else None
    processed = backend.processor(
        messages, enable_thinking=open_msg.enable_thinking, use_tts_template=use_tts
    )
    backend.engine.check_prompt_length(processed.num_tokens)
    embeds = None
    if processed.image_bounds.numel() or processed.audio_bounds.numel():
        embeds = backend.model.embed_prompt(processed).detach()
    return TurnPrompt(processed.input_ids.tolist(), embeds)


def _error_response(err: StageError, identity: common_pb2.Identity | None) -> thinker_pb2.ThinkerResponse:
    ERRORS.labels(STAGE, err.code_name).inc()
    return thinker_pb2.ThinkerResponse(error=err.to_proto(identity))


class ThinkerServicer(thinker_pb2_grpc.ThinkerServiceServicer):
    def __init__(self, backend: ThinkerBackend, info: common_pb2.StageInfo) -> None:
        self.backend = backend
        self.info = info
        self.draining = False  # set by the drain hook: new streams are refused, open ones finish

    async def GetInfo(self, request: common_pb2.GetInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.info

    async def Generate(  # noqa: N802
        self,
        request_iterator: AsyncIterator[thinker_pb2.ThinkerRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[thinker_pb2.ThinkerResponse]:
        REQUESTS.labels(STAGE).inc()
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            err = StageError(
                INVALID_ARGUMENT, "the first message of a Thinker stream must be ThinkerOpen", "open"
            )
            yield _error_response(err, None)
            return
        if self.draining:
            yield _error_response(
                StageError(UNAVAILABLE, "thinker is draining; retry on another replica"), first.open.id
            )
            return
        STREAMS_ACTIVE.labels(STAGE).inc()
        try:
            if first.open.mode == thinker_pb2.STREAM_MODE_DUPLEX:
                from services.thinker.duplex import run_duplex_stream

                async for msg in run_duplex_stream(self.backend, first.open, request_iterator):
                    if msg.WhichOneof("kind") == "error":
                        ERRORS.labels(STAGE, StageError.from_proto(msg.error).code_name).inc()
                    yield msg
            else:
                async for msg in self._turn(first.open, request_iterator):
                    yield msg
        finally:
            STREAMS_ACTIVE.labels(STAGE).dec()

    async def _turn(
        self, open_msg: thinker_pb2.ThinkerOpen, request_iterator: AsyncIterator[thinker_pb2.ThinkerRequest]
    ) -> AsyncIterator[thinker_pb2.ThinkerResponse]:
        backend, engine = self.backend, self.backend.engine
        ident = open_msg.id
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[EngineEvent | thinker_pb2.ThinkerRequest | None] = asyncio.Queue()
        try:
            prompt = await loop.run_in_executor(backend.executor, build_turn_prompt, backend, open_msg)
            sampling = sampling_from_proto(open_msg.sampling, engine.max_context - len(prompt.ids))
            hidden_dtype = dtype_from_proto(open_msg.hidden_dtype) if open_msg.hidden_dtype else None
            seq = engine.open(lambda ev: loop.call_soon_threadsafe(inbox.put_nowait, ev))
        except StageError as err:
            yield _error_response(err, ident)
            return
        except Exception as exc:  # encoder/processor bug: typed INTERNAL, never a bare gRPC failure
            log.exception("thinker prompt build failed")
            yield _error_response(failure("prompt build failed", exc), ident)
            return
        outbox: list[thinker_pb2.ThinkerResponse] = []
        want_speech = bool(open_msg.want_speech)
        turn = TurnOutput(
            backend.tokenizer,
            ident,
            outbox.append,
            hidden_size=backend.hidden_size,
            want_speech=want_speech,
            prompt_ends_with_tts_bos=bool(prompt.ids) and prompt.ids[-1] == TTS_BOS_ID,
            first_chunk_tokens=open_msg.first_chunk_tokens or open_msg.chunk_tokens or DEFAULT_CHUNK_TOKENS,
            chunk_tokens=open_msg.chunk_tokens or DEFAULT_CHUNK_TOKENS,
            hidden_dtype=hidden_dtype,
            stop_ids=frozenset(sampling.stop_token_ids),
            prompt_tokens=len(prompt.ids),
        )
        engine.submit(
            seq,
            WorkItem(
                prompt.ids, prompt.embeds, Sampler(sampling), emit_hidden=want_speech, feed_last=want_speech
            ),
        )

        async def pump_requests() -> None:
            async for req in request_iterator:
                inbox.put_nowait(req)
            inbox.put_nowait(None)  # half-close: nothing more from the client, keep generating

        reader = asyncio.create_task(pump_requests())
        try:
            while True:
                item = await inbox.get()
                if item is None:
                    continue
                if isinstance(item, thinker_pb2.ThinkerRequest):
                    kind = item.WhichOneof("kind")
                    if kind == "control" and item.control.WhichOneof("kind") == "interrupt":
                        INTERRUPTS.labels(STAGE).inc()
                        engine.close(seq)
                        ack = common_pb2.InterruptAck(
                            id=ident, new_epoch=item.control.interrupt.new_epoch, dropped_items=1
                        )
                        yield thinker_pb2.ThinkerResponse(interrupt_ack=ack)
                        turn.finish("interrupted", len(prompt.ids))
                        for msg in outbox:
                            yield msg
                        return
                    if kind == "unit":
                        err = StageError(INVALID_ARGUMENT, "ThinkerUnit is only valid in duplex mode", "unit")
                        engine.close(seq)
                        yield _error_response(err, ident)
                        return
                    continue  # flush / end: nothing buffered to release in turn mode
                ev = item
                if ev.error is not None:
                    yield _error_response(ev.error, ident)
                    return
                if ev.hidden is not None and ev.fed_token is not None:
                    turn.on_row(ev.fed_token, ev.hidden)
                if ev.token is not None:
                    turn.on_token(ev.token, ev.finish_reason)
                if ev.finish_reason is not None:
                    turn.finish(ev.finish_reason, len(prompt.ids))
                for msg in outbox:
                    yield msg
                outbox.clear()
                if ev.finish_reason is not None:
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            engine.close(seq)


def stage_info(backend: ThinkerBackend) -> common_pb2.StageInfo:
    engine = backend.engine
    cfg = backend.ckpt.config
    info = common_pb2.StageInfo(
        stage=STAGE,
        model=str(cfg.get("_name_or_path", "openbmb/MiniCPM-o-4_5")),
        model_version=str(cfg.get("version", "")),
        protocol_version=PROTOCOL_VERSION,
        device=backend.device,
        compute_dtype=dtype_to_proto(engine.layout.dtype),
        capabilities=["turn", "duplex", "image", "audio", "video", "speech_hidden", "interrupt"],
    )
    info.limits["max_context"] = engine.max_context
    info.limits["max_streams"] = engine.config.max_num_seqs
    info.limits["kv_budget_bytes"] = engine.cache.budget_bytes
    info.limits["kv_capacity_tokens"] = engine.cache.capacity_tokens
    info.properties["hidden_size"] = str(engine.hidden_size)
    info.properties["vocab_size"] = str(cfg.get("vocab_size", ""))
    info.properties["kv_block_size"] = str(engine.layout.block_size)
    info.properties["stop_token_ids"] = ",".join(str(i) for i in DEFAULT_STOP_IDS)
    info.properties["cuda_graphs"] = str(engine.runner.use_cuda_graphs).lower()
    return info


def make_server(backend: ThinkerBackend, options: ServeOptions) -> StageServer:
    servicer = ThinkerServicer(backend, stage_info(backend))

    async def drain() -> None:
        servicer.draining = True
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


def parse_size(text: str) -> int:
    """``--kv-budget`` accepts bytes or a suffix: 512M, 20G, 1.5GiB."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in scale:
        return int(float(t[:-1]) * scale[t[-1]])
    return int(float(t))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.thinker", description="MiniCPM-o 4.5 Thinker stage")
    ap.add_argument("--checkpoint", required=True, help="MiniCPM-o 4.5 checkpoint directory")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None)
    ap.add_argument(
        "--kv-budget",
        type=parse_size,
        default=None,
        help="KV cache bytes (e.g. 20G); default: the memory fraction's cap minus the weights and 2 GiB "
        "headroom, or without a fraction 90%% of free GPU memory after the headroom",
    )
    ap.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--max-context", type=int, default=None, help="cap below config max_position_embeddings")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sequences computing at once")
    ap.add_argument(
        "--max-step-tokens", type=int, default=512, help="tokens per engine step (prefill chunk budget)"
    )
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument("--compile", action="store_true", help="torch.compile the per-layer blocks (GPU)")
    ap.add_argument(
        "--graph-warmup-context",
        type=int,
        default=1024,
        help="capture decode CUDA graphs for every batch bucket up to --max-num-seqs and context bucket up "
        "to this many tokens before serving (0: capture lazily, which stalls the engine seconds per new bucket)",
    )
    ap.add_argument(
        "--duplex-window",
        choices=("off", "basic"),
        default="off",
        help="what a duplex session does at the context limit: 'off' ends it with context_length_exceeded; "
        "'basic' keeps the prefix and the newest units within --duplex-window-low tokens once the next unit "
        "could pass --duplex-window-high, and goes on",
    )
    ap.add_argument("--duplex-window-high", type=int, default=8000, help="tokens that trigger a trim (basic)")
    ap.add_argument("--duplex-window-low", type=int, default=6000, help="tokens kept after a trim (basic)")
    ap.add_argument("--log-level", default="INFO")
    add_memory_fraction_argument(ap)
    add_serve_arguments(ap, STAGE)
    return ap


def main(argv: list[str] | None = None) -> None:
    args, fraction = parse_stage_args(build_parser(), STAGE, argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = EngineConfig(
        max_context=args.max_context or 1 << 30,
        max_num_seqs=args.max_num_seqs,
        max_step_tokens=args.max_step_tokens,
        block_size=args.kv_block_size,
        kv_budget_bytes=args.kv_budget,
        use_cuda_graphs=not args.no_cuda_graphs,
        compile_layers=args.compile,
        memory_fraction=apply_memory_cap(STAGE, args.device, fraction, log),
        memory_fraction_key=fraction.key,
    )
    try:
        backend = build_backend(args.checkpoint, args.device, args.dtype, cfg)
    except KVBudgetError as exc:
        raise SystemExit(f"thinker: {exc}") from None
    if args.duplex_window == "basic":
        try:
            window = DuplexWindow(args.duplex_window_high, args.duplex_window_low)
            backend.duplex_window = window.validate(backend.engine.max_context)
        except StageError as exc:
            raise SystemExit(f"thinker: {exc.message}") from None
    if args.kv_budget is not None:
        budget_source = "--kv-budget"
    elif cfg.memory_fraction is not None:
        budget_source = f"memory fraction {cfg.memory_fraction:g} from {fraction.source}"
    else:
        budget_source = "default"
    log.info("thinker KV cache: %.2f GiB (%s)", backend.engine.cache.budget_bytes / 2**30, budget_source)
    t0 = time.perf_counter()
    captured = backend.engine.runner.warmup_graphs(args.max_num_seqs, args.graph_warmup_context)
    if captured:
        log.info("thinker: captured %d decode CUDA graphs in %.1f s", captured, time.perf_counter() - t0)
    backend.engine.start()
    server = make_server(backend, serve_options_from_args(args))
    try:
        asyncio.run(serve_forever(server))
    finally:
        backend.engine.shutdown()
        backend.executor.shutdown(wait=False, cancel_futures=True)
