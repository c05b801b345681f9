"""Thin gRPC front of the Talker: proto messages ⇄ :class:`TalkerEngine` calls.

``TalkerService.Generate`` is one bidirectional stream per request or duplex session:

* first message ``TalkerOpen`` (identity, mode, sampling overrides, window framing);
* then ``TalkerChunk`` (token ids + the Thinker hidden rows as a ``Tensor``, ``is_last`` / ``turn_end``)
  and ``Control`` (interrupt → ``InterruptAck``, flush, end);
* replies: ``CodecWindow`` (3 context + 25 new frames, exactly one ``is_last`` per turn), ``Done``
  (per turn in turn mode, at End in duplex), typed ``Error``.

Half-closing the request side counts as End. The stream skeleton (handshake, request pump, the epoch
rule, typed errors, metrics) is :mod:`services.common.stage_stream`'s; :class:`TalkerStream` is what a
stream means to the engine, which runs in its own thread and posts its outputs into the stream's inbox.
Health, reflection, metrics and graceful drain come from :mod:`services.common.grpc_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import math
import time
from collections.abc import Sequence

import torch

from services.common.checkpoint import CODEC_SILENCE_ID, Checkpoint
from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.grpc_server import (
    ServeOptions,
    StageServer,
    add_serve_arguments,
    serve_forever,
    serve_options_from_args,
)
from services.common.pb import common_pb2, talker_pb2, talker_pb2_grpc
from services.common.stage_settings import add_memory_fraction_argument, apply_memory_cap, parse_stage_args
from services.common.stage_stream import Inbox, Interrupted, StageServicer, StageStream, StageStreamDriver
from services.common.tensors import TORCH_DTYPES, compute_dtype, dtype_to_proto, tensor_from_proto
from services.talker.engine import STAGE, TalkerEngine
from services.talker.kv_cache import SlotBudgetError, check_slot_budget, slot_bytes
from services.talker.model.tts import MiniCPMTTS
from services.talker.streams import (
    ClosedOut,
    ConditionInput,
    DoneOut,
    ErrorOut,
    InterruptAckOut,
    OutMeta,
    Output,
    StreamSettings,
    StreamState,
    WindowOut,
)
from services.talker.warmup import warm_up_streams

log = logging.getLogger(__name__)

SERVICE_NAME = "minicpmo.v1.TalkerService"
PROTOCOL_VERSION = "minicpmo.v1"


def _identity(st: StreamState, meta: OutMeta) -> common_pb2.Identity:
    return common_pb2.Identity(
        request_id=st.settings.request_id,
        session_id=st.settings.session_id,
        epoch=meta.epoch,
        turn_id=meta.turn_id,
        unit_seq=meta.unit_seq,
        chunk_seq=meta.chunk_seq,
    )


def output_to_proto(st: StreamState, out: Output) -> talker_pb2.TalkerResponse | None:
    ident = _identity(st, out.meta)
    if isinstance(out, WindowOut):
        w = out.window
        return talker_pb2.TalkerResponse(
            window=common_pb2.CodecWindow(
                id=ident, codes=w.codes, left_context=w.left_context, is_last=w.is_last
            )
        )
    if isinstance(out, DoneOut):
        usage = common_pb2.Usage(
            prompt_tokens=out.condition_rows,
            completion_tokens=out.frames,
            total_tokens=out.condition_rows + out.frames,
        )
        usage.extra["codec_frames"] = out.frames
        return talker_pb2.TalkerResponse(
            done=common_pb2.Done(id=ident, finish_reason=out.finish_reason, usage=usage)
        )
    if isinstance(out, ErrorOut):
        return talker_pb2.TalkerResponse(error=out.error.to_proto(ident))
    if isinstance(out, InterruptAckOut):
        return talker_pb2.TalkerResponse(
            interrupt_ack=common_pb2.InterruptAck(
                id=ident, new_epoch=out.new_epoch, dropped_items=out.dropped_items
            )
        )
    return None  # ClosedOut carries nothing on the wire


class TalkerServicer(StageServicer, talker_pb2_grpc.TalkerServiceServicer):
    """Maps one Generate stream onto one engine stream."""

    def __init__(self, engine: TalkerEngine, info: common_pb2.StageInfo) -> None:
        self.engine = engine
        self.info = info
        self.driver = StageStreamDriver(
            STAGE, talker_pb2.TalkerRequest, talker_pb2.TalkerResponse, lambda msg: TalkerStream(self, msg)
        )

    def settings_from_open(self, msg: talker_pb2.TalkerOpen) -> StreamSettings:
        sp = msg.sampling
        for name in ("temperature", "top_p", "repetition_penalty"):
            if sp.HasField(name) and not math.isfinite(getattr(sp, name)):  # NaN passes the checks below
                raise StageError(INVALID_ARGUMENT, f"{name} must be a finite number", f"sampling.{name}")
        temperature = sp.temperature if sp.HasField("temperature") else None
        if temperature is not None and temperature < 0:
            raise StageError(
                INVALID_ARGUMENT, "temperature must be ≥ 0 (0 means greedy)", "sampling.temperature"
            )
        if sp.HasField("top_p") and not 0.0 < sp.top_p <= 1.0:
            raise StageError(INVALID_ARGUMENT, "top_p must lie in (0, 1]", "sampling.top_p")
        if sp.HasField("top_k") and sp.top_k < 1:
            raise StageError(INVALID_ARGUMENT, "top_k must be ≥ 1", "sampling.top_k")
        if sp.HasField("repetition_penalty") and sp.repetition_penalty <= 0:
            raise StageError(
                INVALID_ARGUMENT, "repetition_penalty must be > 0", "sampling.repetition_penalty"
            )
        greedy = temperature == 0.0
        sampling = self.engine.default_sampling(
            temperature=1.0 if greedy else temperature,
            top_p=sp.top_p if sp.HasField("top_p") else None,
            top_k=sp.top_k if sp.HasField("top_k") else None,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
            seed=sp.seed if sp.HasField("seed") else None,
            greedy=greedy,
        )
        return self.engine.make_settings(
            request_id=msg.id.request_id,
            session_id=msg.id.session_id,
            duplex=msg.mode == common_pb2.STREAM_MODE_DUPLEX,
            sampling=sampling,
            min_new_frames=sp.min_new_frames if sp.HasField("min_new_frames") else None,
            max_new_frames=sp.max_new_frames if sp.HasField("max_new_frames") else None,
            fixed_frames=sp.fixed_frames if sp.HasField("fixed_frames") else 0,
            window_frames=msg.window_frames,
            # proto3 cannot tell 0 from unset; 0 means the default 3 frames of left context.
            left_context=msg.left_context or None,
            first_window_frames=msg.first_window_frames,
        )

    def condition_from_chunk(self, msg: talker_pb2.TalkerChunk, st: StreamState) -> ConditionInput:
        ids = torch.tensor(list(msg.token_ids), dtype=torch.long)
        if not msg.HasField("hidden"):
            if ids.numel():
                raise StageError(INVALID_ARGUMENT, "chunk has token ids but no hidden tensor", "hidden")
            hidden = torch.zeros(0, self.engine.cfg.llm_dim)
        else:
            hidden = tensor_from_proto(msg.hidden)
            if not hidden.is_floating_point():
                raise StageError(INVALID_ARGUMENT, "hidden must be a floating-point tensor", "hidden.dtype")
        return ConditionInput(
            token_ids=ids,
            hidden=hidden,
            is_last=msg.is_last,
            turn_end=msg.turn_end,
            epoch=msg.id.epoch if msg.HasField("id") else st.epoch,
            turn_id=msg.id.turn_id if msg.HasField("id") else st.turn_id,
            unit_seq=msg.id.unit_seq if msg.HasField("id") else 0,
        )


class TalkerStream(StageStream[talker_pb2.TalkerResponse]):
    """One engine stream: chunks and controls go to the engine thread, its outputs come back as protos.

    An advancing interrupt is applied by the engine between two decode steps; the engine acknowledges
    it itself (``InterruptAckOut``), in order with the windows it already sent.
    """

    data_kind = "chunk"

    def __init__(self, servicer: TalkerServicer, open_msg: talker_pb2.TalkerOpen) -> None:
        self.servicer = servicer
        self.engine = servicer.engine
        self.open_msg = open_msg
        self.settings = servicer.settings_from_open(open_msg)
        self.st: StreamState | None = None

    def identity(self) -> common_pb2.Identity:
        ident = common_pb2.Identity(
            request_id=self.open_msg.id.request_id, session_id=self.open_msg.id.session_id
        )
        if self.st is not None:
            ident.epoch, ident.turn_id = self.st.epoch, self.st.turn_id
        return ident

    async def start(self, inbox: Inbox) -> Sequence[talker_pb2.TalkerResponse]:
        self.st = self.engine.open(self.settings, inbox.post_threadsafe, epoch=self.open_msg.id.epoch)
        return ()

    async def on_data(self, chunk: talker_pb2.TalkerChunk) -> Sequence[talker_pb2.TalkerResponse]:
        assert self.st is not None
        self.engine.chunk(self.st, self.servicer.condition_from_chunk(chunk, self.st))
        return ()

    async def on_interrupt(self, new_epoch: int) -> Interrupted:
        assert self.st is not None
        self.engine.interrupt(self.st, new_epoch)
        return Interrupted(dropped=None)  # the engine acks once it applied it

    async def on_flush(self) -> Sequence[talker_pb2.TalkerResponse]:
        assert self.st is not None
        self.engine.flush(self.st)
        return ()

    async def on_end(self) -> Sequence[talker_pb2.TalkerResponse]:
        assert self.st is not None
        self.engine.end(self.st)
        return ()

    async def on_event(self, event: Output) -> Sequence[talker_pb2.TalkerResponse]:
        assert self.st is not None
        if isinstance(event, ClosedOut):
            self.finished = True
            return ()
        msg = output_to_proto(self.st, event)
        return () if msg is None else [msg]

    async def close(self) -> None:
        if self.st is not None:
            self.engine.close(self.st)


def stage_info(engine: TalkerEngine, ckpt: Checkpoint, device: str) -> common_pb2.StageInfo:
    cfg = engine.cfg
    info = common_pb2.StageInfo(
        stage=STAGE,
        model=str(ckpt.config.get("_name_or_path", "openbmb/MiniCPM-o-4_5")),
        model_version=str(ckpt.config.get("version", "")),
        protocol_version=PROTOCOL_VERSION,
        device=device,
        compute_dtype=dtype_to_proto(engine.model.dtype),
        capabilities=[
            "turn",
            "duplex",
            "streaming_conditions",
            "whole_utterance",
            "fixed_frames",
            "interrupt",
        ],
    )
    info.limits["max_streams"] = engine.runner.cache.num_slots
    info.limits["max_context"] = cfg.max_position_embeddings
    info.limits["codec_vocab"] = cfg.num_audio_tokens
    info.properties["condition_hidden_size"] = str(cfg.llm_dim)
    info.properties["hidden_size"] = str(cfg.hidden_size)
    info.properties["attention_type"] = cfg.attention_type
    info.properties["codec_eos_id"] = str(cfg.eos_id)
    info.properties["codec_silence_id"] = str(CODEC_SILENCE_ID)
    info.properties["cuda_graphs"] = str(engine.runner.use_cuda_graphs).lower()
    prefill_graphs = engine.runner.prefill_graphs
    info.properties["prefill_graphs"] = str(0 if prefill_graphs is None else prefill_graphs.captured)
    return info


def build_engine(
    checkpoint: str,
    device: str,
    dtype: str | None,
    max_streams: int,
    cuda_graphs: bool | None,
    kernels: str | None = None,
    steps_per_replay: int | None = None,
    memory_cap: tuple[float, str] | None = None,
) -> tuple[TalkerEngine, Checkpoint]:
    """Load the talker and build its engine. ``memory_cap`` (the fraction in force and the setting it came
    from) checks that ``max_streams`` KV slots fit it before they are allocated (:class:`SlotBudgetError`)."""
    ckpt = Checkpoint(checkpoint)
    model = MiniCPMTTS.from_checkpoint(ckpt, dtype=compute_dtype(dtype, device), device=device)
    if memory_cap is not None and model.device.type == "cuda":
        torch.cuda.empty_cache()  # loading's temporaries count against the cap but the slots cannot reuse them
        cfg = model.cfg
        check_slot_budget(
            max_streams,
            slot_bytes(
                len(model.model.layers),
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.max_position_embeddings,
                model.dtype,
            ),
            memory_cap[0],
            torch.cuda.get_device_properties(model.device).total_memory,
            max(torch.cuda.memory_reserved(model.device), torch.cuda.memory_allocated(model.device)),
            key=memory_cap[1],
        )
    engine = TalkerEngine(
        model,
        max_streams=max_streams,
        use_cuda_graphs=cuda_graphs,
        kernels=kernels,
        steps_per_replay=steps_per_replay,
    )
    return engine, ckpt


def make_server(engine: TalkerEngine, info: common_pb2.StageInfo, options: ServeOptions) -> StageServer:
    servicer = TalkerServicer(engine, info)

    async def drain() -> None:
        try:
            while not engine.idle():
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            engine.request_cancel_all()
            raise

    return StageServer(
        STAGE,
        SERVICE_NAME,
        lambda server: talker_pb2_grpc.add_TalkerServiceServicer_to_server(servicer, server),
        options,
        drain=drain,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.talker", description="MiniCPM-o 4.5 Talker stage")
    ap.add_argument("--checkpoint", required=True, help="MiniCPM-o 4.5 checkpoint directory")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None)
    ap.add_argument("--max-streams", type=int, default=16, help="KV slots = concurrent streams decoding")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument(
        "--no-graph-warmup", action="store_true", help="capture CUDA graphs lazily instead of at start"
    )
    ap.add_argument(
        "--kernels",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="decode kernels: auto = Triton on CUDA, torch elsewhere (profile kernels)",
    )
    ap.add_argument(
        "--steps-per-replay",
        type=int,
        default=None,
        metavar="K",
        help="decode steps per CUDA-graph replay (default 4 with graphs, 1 without; profile steps_per_replay)",
    )
    ap.add_argument("--log-level", default="INFO")
    add_memory_fraction_argument(ap)
    add_serve_arguments(ap, STAGE)
    return ap


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a native crash (SIGSEGV in a C extension) prints every thread's stack
    args, fraction = parse_stage_args(build_parser(), STAGE, argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cap = apply_memory_cap(STAGE, args.device, fraction, log)  # before the weights load, so they count too
    try:
        engine, ckpt = build_engine(
            args.checkpoint,
            args.device,
            args.dtype,
            args.max_streams,
            False if args.no_cuda_graphs else None,
            kernels=args.kernels,
            steps_per_replay=args.steps_per_replay,
            memory_cap=None if cap is None else (cap, fraction.key),
        )
    except SlotBudgetError as exc:
        raise SystemExit(f"talker: {exc}") from None
    if not args.no_graph_warmup:
        runner = engine.runner
        t0 = time.perf_counter()
        prefill_graphs = runner.warmup_prefill_graphs(engine.max_prefills_per_step)
        if prefill_graphs:
            log.info(
                "captured %d talker prefill CUDA graphs in %.1f s", prefill_graphs, time.perf_counter() - t0
            )
        elif runner.device.type == "cuda":  # the first burst's allocations and first calls, now
            runner.warmup_prefill(engine.max_prefills_per_step)
        graphs = runner.warmup_graphs()
        if graphs:
            log.info("captured %d talker decode CUDA graphs", graphs)
    engine.start()
    if not args.no_graph_warmup and engine.runner.device.type == "cuda":
        t0 = time.perf_counter()  # the eager rest of the path (condition rows, sampling), on its thread
        n = warm_up_streams(engine, (1, engine.max_prefills_per_step))
        log.info("talker warm-up: %d scratch streams in %.1f s", n, time.perf_counter() - t0)
    server = make_server(engine, stage_info(engine, ckpt, args.device), serve_options_from_args(args))
    try:
        asyncio.run(serve_forever(server))
    finally:
        engine.shutdown()
