"""Duplex mode: a persistent per-session KV fed one 1 s unit at a time, with the listen/speak policy.

Session (docs/model.md, Duplex): the open message sets the prefix (system instructions, optional reference
voice rows, optional seeded user text), prefilled once into a *persistent* engine sequence. Each
``ThinkerUnit`` (1 s of audio, up to two frames) appends ``[previous terminator] </unit> <unit>
{frames} {10 audio rows}`` and decodes at most 19 sampled tokens under :class:`DuplexPolicy`; the
engine does not feed a unit's terminator, so the next unit re-injects it (and ``<|chunk_eos|>`` when
the unit hit the 19-token cap), which yields the same token sequence as upstream's feed-after-decode.

Per unit the stream answers with a ``SpeechChunk`` when the unit spoke and ``want_speech`` is set
(span rules of docs/model.md, Thinker to talker hand-off: the first decision token is not spoken; the span
ends before a boundary token or right after ``<|turn_eos|>``;
rows are the hidden states of the span tokens, 1:1) and always a ``UnitResult`` (decision, transcript,
token ids, turn end, context size). After an interrupt (:meth:`DuplexSession.after_interrupt`) the
cancelled unit's fed tokens stay in the KV and the next unit closes it with ``<|chunk_eos|></unit>``.
This module is what a session means to the model; the stream around it (unit queue, encode, window
trims, the epoch fence, Done) is :mod:`services.thinker.duplex_stream`.

Audio rows come from the model's incremental Whisper (one state per session, reset before 1500
encoder positions), fed by upstream's streaming mel (:mod:`services.thinker.processor.duplex_audio`: the
session's audio buffer recomputed per unit, 2 frames of context on each side, the 80-sample carry of the
first unit, the fixed-then-dynamic floor), so the rows equal upstream's (docs/fidelity.md, duplex).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import Histogram

from services.common.audio import resample
from services.common.checkpoint import SPECIAL_TOKEN_IDS
from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import common_pb2, thinker_pb2
from services.common.pcm import pcm_to_float
from services.common.tensors import dtype_from_proto, tensor_to_proto
from services.thinker.backend import ThinkerBackend
from services.thinker.constrained import TOOL_CALL_END_ID, TOOL_CALL_ID, GrammarCompiler
from services.thinker.duplex_policy import (
    CHUNK_EOS,
    CHUNK_TTS_EOS,
    LISTEN,
    SPEAK,
    TTS_BOS,
    TTS_PAD,
    TURN_EOS,
    UNIT_TERMINATORS,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
    ToolCallPlan,
    forbidden_mask_for,
)
from services.thinker.engine import EngineEvent
from services.thinker.prefix_hash import MediaSpan, media_digest
from services.thinker.scheduler import WorkItem
from services.thinker.voice import REFERENCE_ENCODES, voice_key, voice_rows

if TYPE_CHECKING:
    from services.thinker.processor.duplex_audio import DuplexMelChunk

log = logging.getLogger(__name__)

UNIT_PHASE_SECONDS = Histogram(
    "minicpmo_thinker_duplex_unit_seconds",
    "Where a duplex unit's time goes: 'queued' (arrival to start: the session's previous unit still "
    "running), 'encode' (mel + Whisper rows + token ids, on the encode executor), 'behind' (encoded to "
    "submitted: an encode-ahead unit waits for the previous unit's decision, or for a window trim), "
    "'engine' (submit to its decision: prefill, decode steps and sampling, shared with every other "
    "sequence); 'request_behind' and 'request_engine' again for the units that ask for a response "
    "(a commit), whose time is on the way to the response's first audio",
    ["phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

WHISPER_BATCH = Histogram(
    "minicpmo_thinker_whisper_batch_size",
    "Units encoded per streaming-Whisper call (the pending units of every session go in one call; "
    "bench.realtime_duplex reports it per load level)",
    buckets=(1, 2, 4, 8, 16, 32),
)

TTS_EOS = SPECIAL_TOKEN_IDS["<|tts_eos|>"]
UNIT_OPEN = SPECIAL_TOKEN_IDS["<unit>"]
UNIT_CLOSE = SPECIAL_TOKEN_IDS["</unit>"]
# Span boundaries (exclusive); <|turn_eos|> ends a span inclusively.
SPAN_BOUNDARIES = frozenset({TTS_EOS, TTS_PAD, LISTEN, CHUNK_EOS, CHUNK_TTS_EOS, UNIT_OPEN, UNIT_CLOSE})

UNIT_SAMPLES = 16_000


def unit_audio_16k(pcm: common_pb2.Pcm) -> np.ndarray:
    """A unit's audio as exactly 1 s at 16 kHz: resampled, left-padded with silence when short."""
    if not pcm.data:
        return np.zeros(UNIT_SAMPLES, dtype=np.float32)
    samples, rate = pcm_to_float(pcm)
    samples = resample(samples, rate, UNIT_SAMPLES)
    if len(samples) > UNIT_SAMPLES * 3 // 2:
        raise StageError(
            INVALID_ARGUMENT,
            f"a duplex unit carries {len(samples) / UNIT_SAMPLES:.2f} s; expected 1 s",
            "unit.audio",
        )
    if len(samples) < UNIT_SAMPLES:
        samples = np.concatenate([np.zeros(UNIT_SAMPLES - len(samples), np.float32), samples])
    return samples[-UNIT_SAMPLES:]


@dataclass
class PreparedUnit:
    """A unit's audio and frames between their host-side preparation and the encoders
    (see :mod:`services.thinker.duplex_encode`). Nothing here depends on the previous unit's outcome, so a
    unit can be prepared and encoded while the engine still decodes the one before it."""

    session: DuplexSession
    unit: thinker_pb2.ThinkerUnit
    chunk: DuplexMelChunk
    audio_rows: int  # rows its audio adds to the unit's layout
    slices: list[torch.Tensor]  # the frames' vision slices (empty for an audio-only unit)
    tgt: torch.Tensor
    counts: list[int]  # vision rows per frame


@dataclass
class EncodedAudio:
    """A prepared unit with its encoder rows: what :meth:`DuplexSession.assemble_unit` turns into work once
    the previous unit has been decided (its terminator decides the token layout)."""

    prepared: PreparedUnit
    audio: torch.Tensor  # [audio_rows, hidden]
    vision: torch.Tensor | None  # [sum(counts), hidden]


@dataclass
class UnitOutcome:
    """Tokens and rows of one finished unit, turned into the span hand-off and the UnitResult."""

    generated: list[int] = field(default_factory=list)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # generated index -> hidden row
    finish: str | None = None

    def absorb(self, ev: EngineEvent) -> None:
        """Take one engine event of the unit: a fed row's hidden state, a drawn token, the finish."""
        if ev.hidden is not None and ev.fed_token is not None:
            self.rows[len(self.rows)] = ev.hidden
        if ev.token is not None:
            self.generated.append(ev.token)
        if ev.finish_reason is not None:
            self.finish = ev.finish_reason


def select_span(generated: list[int]) -> list[int]:
    """Indices of the spoken tokens of a unit (docs/model.md, Thinker to talker hand-off); a function call
    is not spoken: the span ends before ``<tool_call>`` (see :func:`call_bounds` for the rest)."""
    if not generated or generated[0] in UNIT_TERMINATORS:
        return []
    span: list[int] = []
    for k in range(1, len(generated)):
        tok = generated[k]
        if tok == TTS_BOS:
            span = []  # speech restarts after a <|tts_bos|> inside the unit
            continue
        if tok in SPAN_BOUNDARIES or tok == TOOL_CALL_ID:
            break
        if tok == SPEAK:
            continue
        span.append(k)
        if tok == TURN_EOS:
            break
    return span


def call_bounds(generated: list[int]) -> tuple[int, int] | None:
    """``[start, end)`` of the unit's function call: ``<tool_call>`` through ``</tool_call>``, or, for a call
    that was cut (the token cap, a grammar error), up to the turn's forced end or the unit's end; None
    without a call."""
    if TOOL_CALL_ID not in generated:
        return None
    start = generated.index(TOOL_CALL_ID)
    for end in range(start + 1, len(generated)):
        if generated[end] == TOOL_CALL_END_ID:
            return start, end + 1
        if generated[end] == TURN_EOS or generated[end] in UNIT_TERMINATORS:
            return start, end
    return start, len(generated)


class DuplexSession:
    """What one duplex session means to the model; :class:`~services.thinker.duplex_stream.DuplexStream`
    schedules it."""

    def __init__(self, backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> None:
        from services.thinker.processor.duplex_audio import DuplexAudioStream

        self.backend = backend
        self.engine = backend.engine
        self.model = backend.model
        self.processor = backend.processor
        self.open = open_msg
        self.identity = open_msg.id
        self.epoch = int(open_msg.id.epoch)
        self.sampling = DuplexSampling.from_proto(open_msg.sampling)
        self.hidden_dtype = dtype_from_proto(open_msg.hidden_dtype) if open_msg.hidden_dtype else None
        self.state = PolicyState()
        vocab = int(self.engine.runner.llm.config.vocab_size)
        self.forbidden = forbidden_mask_for(backend.ckpt.root, vocab, self.engine.runner.device)
        self.audio_state = self.model.new_audio_stream()
        self.mel_stream = DuplexAudioStream()
        self.max_audio_positions = int(self.model.dims.audio.max_source_positions)
        self.units_done = 0
        self.reinject: list[int] = []  # tokens the previous unit left unfed (terminator, </unit>)
        self.model_turn_open = False  # a model turn started and has not ended
        self.turn_continues = False  # the last decided unit spoke and left its turn open
        self.chunk_seq = 0
        self.total_generated = 0
        # Function tools: the signatures last placed in the context (a note goes in when they change), the
        # validated grammar text of each tool_call spec seen, and the grammar error of the unit being decided
        # (a unit is assembled only after the previous one was decided and reported).
        self.tools_noted: list[str] = []
        self.grammars: dict[bytes, str] = {}
        self.tool_error = ""

    # ------------------------------------------------------------------------------------- identity
    def ident(self, unit_seq: int = 0) -> common_pb2.Identity:
        ident = common_pb2.Identity()
        ident.CopyFrom(self.identity)
        ident.epoch = self.epoch
        ident.unit_seq = unit_seq
        ident.chunk_seq = self.chunk_seq
        self.chunk_seq += 1
        return ident

    # ----------------------------------------------------------------------------------- embeddings
    def prefix_work(self) -> WorkItem:
        """Session prefix (runs in a worker thread: an inline reference voice goes through Whisper; a
        registered one, ``open.voice``, brings its stored rows)."""
        from services.thinker.processor import AudioClip
        from services.thinker.processor.duplex_layout import duplex_session_prefix

        ref_rows: list[torch.Tensor] = []
        ref_digest = b""
        stored = voice_rows(self.backend, self.open)
        if stored is not None:  # a registered voice: its stored encoder rows, the clip is not encoded
            ref_digest = voice_key(self.open.voice)
            ref_rows = [stored.to(device=self.model.device, dtype=self.model.dtype)]
        elif self.open.ref_audio.data:
            samples, rate = pcm_to_float(self.open.ref_audio)
            ref_digest = media_digest("ref_audio", rate, samples.dtype.str, samples.tobytes())
            feats, lens, _count = self.processor.process_audio(AudioClip(samples, rate), "ref_audio")
            ref_rows = self.model.get_audio_embeds(feats, lens, self.model.dims.audio.chunk_length_s)
            REFERENCE_ENCODES.inc()
        seeded = [
            p.text
            for m in self.open.messages
            if m.role == "user"
            for p in m.content
            if p.WhichOneof("kind") == "text"
        ]
        layout = duplex_session_prefix(
            self.processor.encode_text,
            instructions=self.open.instructions or None,
            ref_audio_rows=sum(int(r.shape[0]) for r in ref_rows),
            seeded_user_text="\n".join(seeded) or None,
        )
        ids, image_bounds, audio_bounds = layout.tensors()
        embeds = None
        media: list[MediaSpan] | None = None
        if ref_rows:
            embeds = self.model.merge_embeddings(ids, None, image_bounds, ref_rows, audio_bounds).detach()
            # The reference voice's rows keyed by its samples, so sessions that open with the same
            # instructions and voice share the prefix's KV (the prefix cache).
            media, rows = [], 0
            for start, end in audio_bounds.tolist():
                media.append(MediaSpan(start, end, ref_digest, rows))
                rows += end - start
        return WorkItem(ids.tolist(), embeds, sampler=None, tag=("prefix", self.epoch), media=media)

    def prepare_unit(self, unit: thinker_pb2.ThinkerUnit) -> PreparedUnit:
        """The unit's mel chunk and frames: the host work before the encoders (advances the mel stream and
        the Whisper cache's reset rule, so units of a session are prepared in order, one at a time)."""
        if len(unit.frames) > 2:
            raise StageError(INVALID_ARGUMENT, "a duplex unit carries at most two frames", "unit.frames")
        chunk = self.mel_stream.push(unit_audio_16k(unit.audio))
        if chunk is None:  # whole 1 s units always complete one; a guard, not a path
            raise StageError(INVALID_ARGUMENT, "a duplex unit carried too little audio", "unit.audio")
        # Matches upstream (get_audio_embedding_streaming): the Whisper cache resets when its length plus
        # the chunk's conv2 length ((T - 1) // 2 + 1, 52 for 104 frames) would reach 1500 positions, i.e.
        # after 29 units, one unit before the positions would actually run out.
        if self.audio_state.frames + (chunk.mel.shape[1] - 1) // 2 + 1 >= self.max_audio_positions:
            self.audio_state.reset()
        slices: list[torch.Tensor] = []
        counts: list[int] = []
        tgt = torch.zeros(0, 2, dtype=torch.long)
        if unit.frames:
            frames = [bytes(f) for f in unit.frames]
            per_frame: int | list[int] = 1 if len(frames) == 1 else [2, 1]
            slices, tgt, counts = self.processor.process_frames(frames, per_frame, "unit.frames")
        # the stride-2 convolution halves the unit's frames, the pooling groups pool_step of them
        audio_rows = (chunk.core.shape[1] // 2) // int(self.model.dims.audio.pool_step)
        return PreparedUnit(self, unit, chunk, audio_rows, slices, tgt, counts)

    @torch.inference_mode()
    def assemble_unit(self, encoded: EncodedAudio, force_speak: bool) -> WorkItem:
        """The unit's work item: its token layout (which re-injects the previous unit's terminator, so this
        runs after that unit's decision), the merged embeddings and this unit's decision policy."""
        from services.thinker.processor.duplex_layout import duplex_unit_layout

        prepared = encoded.prepared
        prev = self.reinject[0] if self.reinject else None
        unit = prepared.unit
        note = self.encode_notes(unit)
        layout = duplex_unit_layout(
            prepared.counts,
            audio_rows=prepared.audio_rows,
            previous_terminator=prev,
            close_previous_unit=len(self.reinject) > 1,
            note_ids=note,
        )
        ids, image_bounds, audio_bounds = layout.tensors()
        embeds = self.model.merge_embeddings(
            ids, encoded.vision, image_bounds, [encoded.audio], audio_bounds
        ).detach()
        if unit.max_output_tokens and self.state.turn_ended:
            # A budget starts with a model turn; a unit inside an open turn does not reset it.
            self.state.turn_budget = int(unit.max_output_tokens)
        force_listen = (
            self.units_done < self.open.force_listen_units
            or unit.force_listen
            or (unit.continue_turn and not self.turn_continues)
        )
        policy = DuplexPolicy(
            self.sampling,
            self.state,
            self.forbidden,
            force_listen=force_listen,
            force_speak=(force_speak and not force_listen),
            tool_call=None if force_listen else self.tool_call_plan(unit),
        )
        speech = bool(self.open.want_speech)
        return WorkItem(list(layout.input_ids), embeds, sampler=policy, emit_hidden=speech, feed_last=True)

    def encode_notes(self, unit: thinker_pb2.ThinkerUnit) -> list[int]:
        """What goes into the context between the previous unit and this one: the client's function results
        (the template's tool message), the offered tools when they changed (the template's tools system
        message) and the response's instructions (a system note), in that order."""
        from services.thinker.processor.duplex_layout import (
            duplex_note_text,
            duplex_tool_outputs_note,
            duplex_tools_note,
        )

        text = ""
        if unit.tool_outputs:
            text += duplex_tool_outputs_note(list(unit.tool_outputs))
        tools = list(unit.tools_json)
        if tools and tools != self.tools_noted:
            text += duplex_tools_note(tools)
            self.tools_noted = tools
        if unit.instructions:
            text += duplex_note_text(unit.instructions)
        return self.processor.encode_text(text) if text else []

    def tool_call_plan(self, unit: thinker_pb2.ThinkerUnit) -> ToolCallPlan | None:
        """The unit's call grammar (compiled once per distinct spec), or None. A grammar that does not
        compile leaves the unit without tools and is reported on its UnitResult (``tool_error``)."""
        self.tool_error = ""
        spec = unit.tool_call
        if not unit.HasField("tool_call") or spec.kind != thinker_pb2.Constraint.KIND_TOOL_CALLS:
            return None
        compiler = self.backend.grammar
        if compiler is None:  # a backend assembled by hand (tests): build the token table now
            compiler = self.backend.grammar = GrammarCompiler(
                self.processor.tokenizer, len(self.processor.tokenizer)
            )
        key = spec.SerializeToString(deterministic=True)
        grammar = self.grammars.get(key)
        if grammar is None:
            try:
                grammar = compiler.grammar(spec)
                compiler.from_grammar(grammar)  # validates (compiles) it once
            except StageError as err:
                self.tool_error = err.message
                return None
            self.grammars[key] = grammar
        text = grammar
        return ToolCallPlan(
            lambda: compiler.from_grammar(text, check=False), forced=bool(unit.tool_call_forced)
        )

    # -------------------------------------------------------------------------------------- results
    def unit_responses(
        self, unit_seq: int, outcome: UnitOutcome, context_tokens: int
    ) -> list[thinker_pb2.ThinkerResponse]:
        gen = outcome.generated
        self.total_generated += len(gen)
        # What the next unit must re-inject: the unfed terminator (or the forced <|chunk_eos|>), </unit>.
        if outcome.finish == "stop" and gen:
            self.reinject = [gen[-1], UNIT_CLOSE]
        else:
            self.reinject = [CHUNK_EOS, UNIT_CLOSE]
        self.units_done += 1
        span = select_span(gen)
        speak = bool(gen) and gen[0] not in UNIT_TERMINATORS
        call = call_bounds(gen)
        call_text, call_cut = "", False
        if call is not None:
            tok = self.processor.tokenizer
            call_text = tok.decode(gen[call[0] : call[1]], skip_special_tokens=False)
            call_cut = gen[call[1] - 1] != TOOL_CALL_END_ID
            # The <|turn_eos|> after the call closes the span of text spoken before it in this unit; a unit
            # that only called has nothing to voice (the gateway ends an open talker stream itself).
            if call[1] < len(gen) and gen[call[1]] == TURN_EOS and span:
                span.append(call[1])
        turn_end = any(gen[k] == TURN_EOS for k in span) or call is not None
        capped = turn_end and self.state.budget_spent
        if turn_end:
            self.state.budget_spent = False
        elif not speak and self.state.turn_ended:
            self.state.turn_budget = None  # the model listened: the budget's turn never started
        self.turn_continues = speak and not turn_end
        out: list[thinker_pb2.ThinkerResponse] = []
        tok = self.processor.tokenizer
        transcript = tok.decode([gen[k] for k in span], skip_special_tokens=True) if span else ""
        # Every span token was fed back (feed_last covers the 19-token cap), so each has its row.
        spoken = [k for k in span if k in outcome.rows]
        if spoken and self.open.want_speech:
            ids = [gen[k] for k in spoken]
            hidden = torch.stack([outcome.rows[k] for k in spoken])
            chunk = thinker_pb2.SpeechChunk(
                id=self.ident(unit_seq),
                token_ids=ids,
                hidden=tensor_to_proto(hidden, self.hidden_dtype),
                text=transcript,
                turn_start=not self.model_turn_open,
                turn_end=turn_end,
                segment_end=True,
                is_last=turn_end,
            )
            out.append(thinker_pb2.ThinkerResponse(speech=chunk))
        if span:
            self.model_turn_open = not turn_end
        if call is not None:
            self.model_turn_open = False  # the call ended the model's turn
        result = thinker_pb2.UnitResult(
            id=self.ident(unit_seq),
            decision=thinker_pb2.UNIT_DECISION_SPEAK if speak else thinker_pb2.UNIT_DECISION_LISTEN,
            transcript=transcript,
            token_ids=gen,
            turn_end=turn_end,
            context_tokens=context_tokens,
            max_tokens_reached=capped,
            tool_call=call_text,
            tool_call_truncated=call_cut,
            tool_error=self.tool_error,
        )
        out.append(thinker_pb2.ThinkerResponse(unit=result))
        return out

    def after_interrupt(self, new_epoch: int) -> None:
        self.epoch = new_epoch
        self.state.turn_ended = True
        self.state.turn_budget = None
        self.state.budget_spent = False
        self.model_turn_open = False
        self.turn_continues = False
        self.reinject = [CHUNK_EOS, UNIT_CLOSE]
        # A dropped unit may have carried the tools note: place it again with the next unit that offers tools.
        self.tools_noted = []
