"""Turn mode of the thinker: one chat request per stream, from ThinkerOpen to Done.

``ThinkerOpen`` (messages, sampling, template switches, speech export settings) becomes one engine work
item (prompt ids + encoder embeddings); the engine's events become ``TextDelta`` per token, ``SpeechChunk``
(spoken span ids + hidden rows, :class:`~services.thinker.turn.TurnOutput`) and one ``Done``. An
interrupt to a newer epoch cancels the request: ``InterruptAck`` (1 dropped), then ``Done(interrupted)``.
Half-closing the request side does not stop generation. The stream skeleton is
:mod:`services.common.stage_stream`'s; this module is the turn's part only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import Histogram

from services.common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_ARGUMENT, StageError
from services.common.pb import common_pb2, thinker_pb2
from services.common.pcm import pcm_to_float
from services.common.stage_stream import Inbox, Interrupted, StageStream
from services.common.tensors import dtype_from_proto
from services.thinker.backend import ThinkerBackend
from services.thinker.constrained import GrammarCompiler
from services.thinker.engine import EngineEvent
from services.thinker.engine_metrics import PHASE_BUCKETS
from services.thinker.errors import failure
from services.thinker.prefix_hash import MediaSpan
from services.thinker.sampling import DEFAULT_STOP_IDS, Sampler, SamplingConfig, StopCheck, StopText
from services.thinker.scheduler import Sequence as EngineSequence
from services.thinker.scheduler import WorkItem
from services.thinker.turn import TTS_BOS_ID, IncrementalDetokenizer, TurnOutput
from services.thinker.voice import REFERENCE_ENCODES

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048
PROMPT_BUILD_SECONDS = Histogram(
    "minicpmo_thinker_prompt_build_seconds",
    "A turn's prompt building on the encode executor: 'wait' for a free worker, 'build' the template, "
    "media decoding and the encoders (a transcription window's audio encoder pass is here)",
    ["phase"],
    buckets=PHASE_BUCKETS,
)
DEFAULT_CHUNK_TOKENS = 10
Response = thinker_pb2.ThinkerResponse


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
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        stop=tuple(msg.stop),
        logprobs=bool(msg.logprobs),
        top_logprobs=int(msg.top_logprobs) if msg.logprobs else 0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
    )
    return cfg.validate()


def make_sampler(backend: ThinkerBackend, msg: thinker_pb2.SamplingParams, config: SamplingConfig) -> Sampler:
    """The request's sampler: its grammar matcher (compiled here, off the engine thread) and stop check."""
    config.check_vocab(len(backend.tokenizer))
    sampler = Sampler(config)
    if msg.HasField("constraint") and msg.constraint.kind != thinker_pb2.Constraint.KIND_UNSPECIFIED:
        compiler = backend.grammar
        if compiler is None:  # a backend assembled by hand (tests): build the token table now
            compiler = backend.grammar = GrammarCompiler(backend.tokenizer, len(backend.tokenizer))
        sampler.constraint = compiler.matcher(msg.constraint)
    if config.stop:
        sampler.stop_check = StopCheck(IncrementalDetokenizer(backend.tokenizer), StopText(config.stop))
    return sampler


def messages_from_proto(backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> list[Any]:
    """Proto chat messages → processor messages (media stay encoded; the processor decodes them)."""
    from services.thinker.processor import AudioClip, AudioInput, ImageInput, Message, VideoInput
    from services.thinker.processor.chat import ToolCall, speech_system_message

    out: list[Any] = []
    if (open_msg.want_speech or open_msg.teacher_text) and open_msg.ref_audio.data:
        samples, rate = pcm_to_float(open_msg.ref_audio)
        out.append(speech_system_message(AudioClip(samples, rate)))
        REFERENCE_ENCODES.inc()  # the prompt's audio encoder pass takes the clip too
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
        calls = [ToolCall(c.name, c.arguments, c.id) for c in m.tool_calls]
        out.append(Message(m.role, parts, calls))
    return out


@dataclass
class TurnPrompt:
    ids: list[int]
    embeds: torch.Tensor | None
    # Teacher-forced speech: how many of ``ids`` (at the end) are the forced spoken tokens.
    forced: int = 0
    media: list[MediaSpan] | None = None  # the embedded rows' content keys (prefix caching)


def build_turn_prompt(backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> TurnPrompt:
    """Chat template + placeholder expansion + encoders (runs in a worker thread: encoders block).

    A registered voice (``open_msg.voice``) puts its speech system turn first: ids and input rows derived
    once per voice (:class:`~services.thinker.voice.VoicePrefixCache`). When nothing else in the prompt
    is embedded from media, the work item's ``embeds`` are those prefix rows only and the rest of the
    prompt stays token ids, so building it does no device work, as for a prompt without a voice."""
    if not open_msg.messages:
        raise StageError(INVALID_ARGUMENT, "messages must not be empty", "messages")
    messages = messages_from_proto(backend, open_msg)
    teacher = bool(open_msg.teacher_text)
    speaking = bool(open_msg.want_speech) or teacher
    voice = backend.voice_prefixes.get(backend, open_msg) if speaking else None
    use_tts = True if (open_msg.use_tts_template or speaking) else None
    processed = backend.processor(
        messages,
        enable_thinking=open_msg.enable_thinking,
        use_tts_template=use_tts,
        tools=list(open_msg.tools_json),
    )
    ids = processed.input_ids.tolist()
    forced: list[int] = []
    if teacher:
        forced = list(backend.tokenizer.encode(open_msg.teacher_text, add_special_tokens=False))
        if not forced:
            raise StageError(INVALID_ARGUMENT, "teacher_text has no tokens", "teacher_text")
    prefix_ids = voice.ids if voice is not None else []
    backend.engine.check_prompt_length(len(prefix_ids) + len(ids) + len(forced))
    embeds = None
    if processed.image_bounds.numel() or processed.audio_bounds.numel():
        embeds = backend.model.embed_prompt(processed).detach()
    media: list[MediaSpan] | None = None
    if embeds is not None:
        with torch.inference_mode():
            parts = [embeds]
            if voice is not None:
                parts.insert(0, voice.embeds.to(embeds.dtype))
            if forced:  # the forced tokens are plain text rows
                text_rows = backend.model.embed_tokens(torch.tensor(forced, device=embeds.device))
                parts.append(text_rows.to(embeds.dtype))
            embeds = torch.cat(parts).detach() if len(parts) > 1 else embeds
        # every embedded row named by content: a cached block is reused only for equal rows
        media = [span.shifted(len(prefix_ids)) for span in processed.media_spans]
    elif voice is not None:  # only the voice's rows are embedded: the rest of the prompt is token ids
        embeds = voice.embeds
        media = []
    if voice is not None and media is not None:  # the voice's stored rows (with the text around them)
        media.insert(0, MediaSpan(0, len(prefix_ids), voice.key))
    return TurnPrompt(prefix_ids + ids + forced, embeds, len(forced), media)


def _timed_build(backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen, submitted: float) -> TurnPrompt:
    """:func:`build_turn_prompt` on the executor, with its wait since ``submitted`` and its build time
    observed."""
    start = time.perf_counter()
    PROMPT_BUILD_SECONDS.labels("wait").observe(start - submitted)
    try:
        return build_turn_prompt(backend, open_msg)
    finally:
        PROMPT_BUILD_SECONDS.labels("build").observe(time.perf_counter() - start)


class TurnStream(StageStream[Response]):
    """One chat request: the prompt is built at start, then engine events are translated until Done."""

    data_kind = None  # turn mode takes no data messages after open

    def __init__(self, backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.open_msg = open_msg
        self.seq: EngineSequence | None = None
        self.turn: TurnOutput | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, found in the prefix cache (the engine's events say)
        self.outbox: list[Response] = []

    def identity(self) -> common_pb2.Identity:
        ident = common_pb2.Identity()
        ident.CopyFrom(self.open_msg.id)
        return ident

    async def start(self, inbox: Inbox) -> Sequence[Response]:
        backend, engine, open_msg = self.backend, self.engine, self.open_msg
        loop = asyncio.get_running_loop()
        try:
            prompt = await loop.run_in_executor(
                backend.executor, _timed_build, backend, open_msg, time.perf_counter()
            )
        except StageError:
            raise
        except Exception as exc:  # encoder/processor bug: typed INTERNAL, never a bare gRPC failure
            log.exception("thinker prompt build failed")
            raise failure("prompt build failed", exc) from exc
        teacher = prompt.forced > 0
        room = engine.max_context - len(prompt.ids)
        sampling = sampling_from_proto(open_msg.sampling, max(room, 1) if teacher else room)
        sampler = await loop.run_in_executor(
            backend.executor, make_sampler, backend, open_msg.sampling, sampling
        )
        hidden_dtype = dtype_from_proto(open_msg.hidden_dtype) if open_msg.hidden_dtype else None
        want_speech = bool(open_msg.want_speech) or teacher
        self.prompt_tokens = len(prompt.ids)
        self.turn = TurnOutput(
            backend.tokenizer,
            open_msg.id,
            self.outbox.append,
            hidden_size=backend.hidden_size,
            want_speech=want_speech,
            prompt_ends_with_tts_bos=bool(prompt.ids) and prompt.ids[-1 - prompt.forced] == TTS_BOS_ID,
            first_chunk_tokens=open_msg.first_chunk_tokens or open_msg.chunk_tokens or DEFAULT_CHUNK_TOKENS,
            chunk_tokens=open_msg.chunk_tokens or DEFAULT_CHUNK_TOKENS,
            hidden_dtype=hidden_dtype,
            stop_ids=frozenset(sampling.stop_token_ids),
            prompt_tokens=len(prompt.ids),
            stop=sampling.stop,
            top_logprobs=sampling.top_logprobs if sampling.logprobs else None,
        )
        self.seq = engine.open(inbox.post_threadsafe)
        if teacher:  # prefill only: the forced tokens' rows come back as they are prefilled
            self.prompt_tokens -= prompt.forced
            self.turn.prompt_tokens = self.prompt_tokens
            work = WorkItem(
                prompt.ids,
                prompt.embeds,
                None,
                export_from=len(prompt.ids) - prompt.forced,
                media=prompt.media,
            )
        else:
            work = WorkItem(
                prompt.ids,
                prompt.embeds,
                sampler,
                emit_hidden=want_speech,
                feed_last=want_speech,
                media=prompt.media,
            )
        engine.submit(self.seq, work)
        return ()

    def _drain_outbox(self) -> list[Response]:
        out, self.outbox[:] = list(self.outbox), []
        return out

    async def on_interrupt(self, new_epoch: int) -> Interrupted:
        assert self.turn is not None and self.seq is not None
        self.engine.close(self.seq)
        self.turn.finish("interrupted", self.prompt_tokens)
        self.finished = True
        return Interrupted(dropped=1, then=self._drain_outbox())

    def on_unexpected(self, kind: str | None) -> Sequence[Response]:
        if kind == "unit":
            raise StageError(INVALID_ARGUMENT, "ThinkerUnit is only valid in duplex mode", "unit")
        return super().on_unexpected(kind)

    async def on_event(self, ev: EngineEvent) -> Sequence[Response]:
        assert self.turn is not None
        if ev.error is not None:
            raise ev.error
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.prompt_rows is not None and ev.prompt_row_ids is not None:
            self.turn.on_forced(ev.prompt_row_ids, ev.prompt_rows)
        if ev.hidden is not None and ev.fed_token is not None:
            self.turn.on_row(ev.fed_token, ev.hidden)
        if ev.token is not None:
            self.turn.on_token(ev.token, ev.finish_reason, ev.logprobs)
        if ev.finish_reason is not None:
            reason = "stop" if ev.finish_reason == "prefilled" else ev.finish_reason
            self.turn.finish(reason, self.prompt_tokens, self.cached_tokens)
            self.finished = True
        return self._drain_outbox()

    async def close(self) -> None:
        if self.seq is not None:
            self.engine.close(self.seq)
