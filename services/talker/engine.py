"""Talker engine: continuous batching of codec decoding across streams, one loop per device.

Design
------
* **Slots.** Each stream with work holds one slot of the static KV cache (:mod:`kv_cache`) from the
  start of a turn to its end; streams beyond the slot count wait in FIFO order. Every step runs the
  prefills that are ready (one condition each, up to ``max_prefills_per_step``, together in one padded
  forward), then **one batched decode step** for every stream that has a frame to feed, so streams join
  and leave the batch between any two steps.
* **Per-request state** (:mod:`streams`): sampling params, the seed's draw counter, the 16-frame
  penalty history, budgets, the window buffer and the previous segment. Sampling is batched with
  per-row rules (:mod:`sampling`) inside the decode step's CUDA graph; only the picked ids come back.
* **Turn forms** (the first chunk of a turn decides):

  - *whole utterance* — the first chunk is also the last. Condition ``cond + text_eos + audio_bos``;
    upstream ``MiniCPMTTS.generate`` rules: step 0 raw, EOS masked for the first ``min_new_frames``
    (50), at most ``max_new_frames`` (2048) or until the context is full. This is the fidelity path.
  - *streaming* — several chunks. Each chunk's condition is ``cond + (text_eos if last) + audio_bos``
    and the Talker then decodes **until it samples EOS** (at most 500 samples per chunk), exactly as
    upstream ``TTSStreamingGenerator.generate_with_buffer``: the model was trained to stop once it has
    voiced the text it has seen, so frames per chunk are the model's own decision, not a fixed ratio;
    the chunk flagged last runs to its EOS and ends the turn. No EOS floor (upstream has none here),
    only the stream's first sample is raw. Context between chunks follows ``tts_config.attention_type``:
    ``sliding_recompute`` (the released value) drops the KV and recomputes ``previous condition +
    previous chunk's frames + this condition`` from position 0; ``full_attention`` appends to the KV.
  - *duplex* — one chunk per 1 s unit, condition ``cond + audio_bos`` appended to the turn's KV;
    26 samples (the 26th dropped → 25 frames), EOS masked throughout except at turn start; a chunk
    flagged ``turn_end`` gets up to 104 samples, no floor, EOS ignored 5 steps after each 25-frame
    boundary; temperature + penalty only, penalty history per unit (upstream ``generate_chunk``).
    When the next unit would not fit the 4096 context, it **rolls over** to a one-chunk recompute
    window (``previous unit's condition + its frames + this condition`` from position 0). A turn end
    or a new ``turn_id`` resets everything.
* **Fixed frame count** (benchmarks): the turn's chunks are gathered into one whole-utterance
  condition, EOS is never sampled and the turn ends after exactly N frames.
* **Output**: codec windows (:mod:`windows`): 3 left-context + 25 new frames, the first window padded
  with silence 4218, optional smaller first window, exactly one ``is_last`` window per turn.
* **Interrupts**: the epoch rule is the stream driver's (:mod:`services.common.stage_stream`); the
  engine applies an advancing interrupt between two steps (between two blocks of K steps with
  :mod:`multistep`): it drops queued chunks and in-flight
  decoding, resets the turn and answers with ``InterruptAck`` in order with the windows already sent.
  (Its own checks of older/equal epochs only matter to callers that drive the engine directly.)

Threading: :meth:`TalkerEngine.start` runs :meth:`step` in a dedicated thread (torch calls block);
the gRPC front talks to it only through :meth:`submit` (thread-safe) and each stream's ``emit``
callback. Tests drive :meth:`step` directly.

Size: this module is ~700 lines, over the project's ~500, because one class owns the step loop and the
segment rules of the three turn forms, which all mutate the same per-stream state between two batched
steps; the pure parts are already apart (:mod:`streams`, :mod:`sampling`, :mod:`windows`,
:mod:`kv_cache`). Splitting the segment rules out would mean passing the engine's slot, cache and
batch bookkeeping into every one of them.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from prometheus_client import Counter, Gauge, Histogram

from services.common.device import to_device
from services.common.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    StageError,
)
from services.common.memory_watch import MemoryWatch
from services.common.metrics import BATCH_SIZE, IN_FLIGHT, INTERRUPT_DRAIN, QUEUE_DEPTH, STEP_SECONDS
from services.common.slow_steps import StepTimer
from services.talker import multistep
from services.talker import sampling as smp
from services.talker.model.config import DEFAULT_MAX_NEW_FRAMES, DEFAULT_MIN_NEW_FRAMES
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import TalkerRunner
from services.talker.streams import (
    ClosedOut,
    ConditionInput,
    DoneOut,
    ErrorOut,
    InterruptAckOut,
    Output,
    Phase,
    StreamSettings,
    StreamState,
    TurnForm,
    WindowOut,
)

log = logging.getLogger(__name__)

STAGE = "talker"
STREAMING_MAX_SAMPLES_PER_CHUNK = 500  # upstream generate_with_buffer(max_new_token=500)

FRAMES = Counter("minicpmo_talker_frames_total", "Codec frames emitted (rate() gives frames/s)")
ACTIVE_STREAMS = Gauge("minicpmo_talker_engine_streams", "Streams known to the Talker engine")
DECODE_ROWS = Gauge("minicpmo_talker_decode_batch", "Rows in the latest batched decode step")
PREFILL_BATCH = Histogram(
    "minicpmo_talker_prefill_batch",
    "Streams whose segment prefills ran together in one forward",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16),
)


@dataclass
class _Command:
    kind: str  # open | chunk | interrupt | flush | end | close
    stream: StreamState
    payload: object = None
    submitted: float = field(default_factory=time.perf_counter)  # interrupt/close drain timing


class TalkerEngine:
    """Continuous-batching scheduler over a :class:`TalkerRunner`."""

    def __init__(
        self,
        model: MiniCPMTTS,
        *,
        max_streams: int = 16,
        max_prefills_per_step: int = 8,
        use_cuda_graphs: bool | None = None,
        streaming_max_samples_per_chunk: int = STREAMING_MAX_SAMPLES_PER_CHUNK,
        kernels: str | None = None,
        steps_per_replay: int | None = None,
    ) -> None:
        """``steps_per_replay``: decode steps per graph replay (:mod:`multistep`); default
        :func:`multistep.select_steps` (4 with CUDA graphs, 1 without; the profile's ``steps_per_replay``)."""
        self.model = model
        self.cfg = model.cfg
        self.runner = TalkerRunner(
            model, num_slots=max_streams, use_cuda_graphs=use_cuda_graphs, kernels=kernels
        )
        self.steps_per_replay = multistep.select_steps(steps_per_replay, self.runner.use_cuda_graphs)
        if self.steps_per_replay > 1:
            self.runner.blocks = multistep.BlockDecoder(self.runner, self.steps_per_replay)
        self.max_prefills_per_step = max_prefills_per_step
        self.streaming_chunk_cap = streaming_max_samples_per_chunk
        self.eos = self.cfg.eos_id
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._wake = threading.Event()
        self._streams: list[StreamState] = []
        self._waiting: deque[StreamState] = deque()  # streams with work but no slot yet
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cancel_all = threading.Event()
        self.frames_emitted = 0
        # Labelled metric children resolved once (a labels() lookup per step is measurable host time).
        self._in_flight = IN_FLIGHT.labels(STAGE)
        self._queue_depth = QUEUE_DEPTH.labels(STAGE)
        self._batch_size = BATCH_SIZE.labels(STAGE)
        self._step_seconds = STEP_SECONDS.labels(STAGE)
        self._timer = StepTimer(STAGE)  # logs a step slower than slow_step_ms with its phases
        self._memory = MemoryWatch(STAGE, torch.device(self.runner.device))  # allocator gauges, high-water
        # Optional tap on the raw fp32 logits each stream samples from (fidelity dumps, tests).
        self.logits_observer: Callable[[StreamState, torch.Tensor], None] | None = None

    # ------------------------------------------------------------------------------- public API
    def default_sampling(self, **overrides: object) -> smp.SamplingParams:
        base: dict[str, object] = {
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "top_k": self.cfg.top_k,
            "repetition_penalty": self.cfg.repetition_penalty,
            "seed": self.cfg.seed,
            "greedy": False,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return smp.SamplingParams(**base)  # type: ignore[arg-type]

    def make_settings(
        self,
        *,
        request_id: str = "",
        session_id: str = "",
        duplex: bool = False,
        sampling: smp.SamplingParams | None = None,
        min_new_frames: int | None = None,
        max_new_frames: int | None = None,
        fixed_frames: int = 0,
        window_frames: int = 0,
        left_context: int | None = None,
        first_window_frames: int = 0,
    ) -> StreamSettings:
        from services.talker.windows import DEFAULT_LEFT_CONTEXT, DEFAULT_WINDOW_FRAMES

        return StreamSettings(
            request_id=request_id,
            session_id=session_id,
            duplex=duplex,
            sampling=sampling or self.default_sampling(),
            min_new_frames=DEFAULT_MIN_NEW_FRAMES if min_new_frames is None else int(min_new_frames),
            max_new_frames=DEFAULT_MAX_NEW_FRAMES if not max_new_frames else int(max_new_frames),
            fixed_frames=int(fixed_frames),
            window_frames=window_frames or DEFAULT_WINDOW_FRAMES,
            left_context=DEFAULT_LEFT_CONTEXT if left_context is None else int(left_context),
            first_window_frames=int(first_window_frames),
        )

    def open(self, settings: StreamSettings, emit: Callable[[Output], None], epoch: int = 0) -> StreamState:
        st = StreamState(settings=settings, emit=emit, epoch=epoch)
        self._submit(_Command("open", st))
        return st

    def chunk(self, st: StreamState, cond: ConditionInput) -> None:
        """Queue a condition; shape/range problems raise :class:`StageError` here, in the caller's thread."""
        self.model.validate_condition_inputs(cond.token_ids, cond.hidden)
        self._submit(_Command("chunk", st, cond))

    def interrupt(self, st: StreamState, new_epoch: int) -> None:
        self._submit(_Command("interrupt", st, int(new_epoch)))

    def flush(self, st: StreamState) -> None:
        self._submit(_Command("flush", st))

    def end(self, st: StreamState) -> None:
        self._submit(_Command("end", st))

    def close(self, st: StreamState) -> None:
        """The client is gone: drop everything of this stream now."""
        self._submit(_Command("close", st))

    def _submit(self, cmd: _Command) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def running(self) -> bool:
        """Whether the engine thread drives :meth:`step` (else the caller does, e.g. warm-ups and tests)."""
        return self._thread is not None

    # ------------------------------------------------------------------------------ loop thread
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="talker-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception:  # a bug must not kill the loop silently for every other stream
                log.exception("talker engine step failed")
                self._fail_all(StageError(INTERNAL, "talker engine step failed; see server log"))
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Drive :meth:`step` until nothing is left to do (tests, dump, benchmarks)."""
        steps = 0
        while self.step():
            steps += 1
            if steps >= max_steps:
                raise RuntimeError("talker engine did not go idle")
        return steps

    # ------------------------------------------------------------------------------- scheduling
    def step(self) -> bool:
        """Apply commands, run ready prefills, then one batched decode step. True if anything happened."""
        timer = self._timer
        timer.start()
        did = self._drain_commands()
        if self._cancel_all.is_set():
            self._cancel_all.clear()
            self.cancel_all()
        self._admit()
        timer.mark("commands")
        ready = [st for st in self._streams if st.phase is Phase.IDLE and st.slot is not None and st.queue]
        if ready:
            did = True
            self._start_segments(ready[: self.max_prefills_per_step])
            timer.mark("prefill", streams=min(len(ready), self.max_prefills_per_step))
        decoding = [st for st in self._streams if st.phase is Phase.DECODE and st.slot is not None]
        if decoding:
            did = True
            self._decode(decoding)
            timer.mark("decode", batch=len(decoding), steps=self.steps_per_replay)
        timer.finish()
        self._memory.check()
        for st in list(self._streams):
            if st.phase is Phase.IDLE and not st.queue:
                self._maybe_finish_idle(st)
        self._in_flight.set(self.runner.cache.num_slots - self.runner.cache.free_slots)
        self._queue_depth.set(len(self._waiting))
        ACTIVE_STREAMS.set(len(self._streams))
        return did

    def _guarded(self, st: StreamState, fn: Callable[[StreamState], None]) -> None:
        try:
            fn(st)
        except StageError as err:
            self._error(st, err)
        except ValueError as err:
            self._error(st, StageError(INVALID_ARGUMENT, str(err)))
        except Exception:  # a bug in one stream's bookkeeping must not take the batch down
            log.exception("talker stream %s failed", st.settings.request_id)
            self._error(st, StageError(INTERNAL, "talker failed on this stream; see server log"))

    def _drain_commands(self) -> bool:
        did = False
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return did
            did = True
            st = cmd.stream
            if cmd.kind == "open":
                self._streams.append(st)
            elif st not in self._streams:
                continue  # already closed
            elif cmd.kind == "chunk":
                self._on_chunk(st, cmd.payload)  # type: ignore[arg-type]
            elif cmd.kind == "interrupt":
                new_epoch = cast(int, cmd.payload)
                if new_epoch > st.epoch:
                    self._observe_drain(st, cmd, idle_counts=True)
                self._on_interrupt(st, new_epoch)
            elif cmd.kind == "flush":
                if st.windower is not None:
                    for w in st.windower.flush_partial(min_new=1):
                        st.emit(WindowOut(st.meta(), w))
            elif cmd.kind == "end":
                st.ending = True
            elif cmd.kind == "close":
                self._observe_drain(st, cmd, idle_counts=False)
                self._remove(st)

    @staticmethod
    def _observe_drain(st: StreamState, cmd: _Command, idle_counts: bool) -> None:
        """Stage-side barge-in latency: commands apply between steps, so the wait since the command
        arrived is the time the old epoch's last decode step still ran."""
        running = st.phase is Phase.DECODE or st.in_turn
        if running:
            INTERRUPT_DRAIN.labels("talker").observe(time.perf_counter() - cmd.submitted)
        elif idle_counts:
            INTERRUPT_DRAIN.labels("talker").observe(0.0)

    def _on_chunk(self, st: StreamState, cond: ConditionInput) -> None:
        if cond.epoch < st.epoch:
            return  # stale work of an interrupted epoch
        if cond.epoch > st.epoch:
            self._reset_turn(st)
            st.epoch = cond.epoch
            st.skip_to_last = False
        if st.ending:
            self._error(st, StageError(FAILED_PRECONDITION, "chunk after End", "chunk"), close=False)
            return
        if st.skip_to_last and not st.settings.duplex:
            st.skip_to_last = not cond.is_last  # a chunk of the turn that ended on its frame budget
            return
        if st.settings.fixed_frames and not st.settings.duplex:
            # Benchmarks: a fixed frame count is a whole-utterance run; gather the turn's chunks first.
            st.fixed_parts.append(cond)
            if not cond.is_last:
                return
            parts, st.fixed_parts = st.fixed_parts, []
            cond = ConditionInput(
                torch.cat([p.token_ids.reshape(-1) for p in parts]),
                torch.cat([p.hidden for p in parts], dim=0),
                True,
                cond.turn_end,
                cond.epoch,
                cond.turn_id,
                cond.unit_seq,
            )
        st.queue.append(cond)
        if st.slot is None and st not in self._waiting:
            self._waiting.append(st)

    def _on_interrupt(self, st: StreamState, new_epoch: int) -> None:
        if new_epoch <= st.epoch:
            st.emit(InterruptAckOut(st.meta(), new_epoch, 0))
            return
        dropped = len(st.queue) + len(st.fixed_parts) + (1 if st.phase is Phase.DECODE or st.in_turn else 0)
        st.queue.clear()
        st.fixed_parts.clear()
        st.skip_to_last = False
        self._reset_turn(st)
        st.epoch = new_epoch
        st.emit(InterruptAckOut(st.meta(), new_epoch, dropped))

    def _reset_turn(self, st: StreamState) -> None:
        st.form = None
        st.phase = Phase.IDLE
        st.pending_code = None
        self._release_slot(st)

    def _admit(self) -> None:
        while self._waiting and self.runner.cache.free_slots:
            st = self._waiting.popleft()
            if st not in self._streams or st.slot is not None or not st.queue:
                continue
            st.slot = self.runner.cache.allocate()

    def _release_slot(self, st: StreamState) -> None:
        if st.slot is not None:
            self.runner.cache.release(st.slot)
            st.slot = None
        if st.queue and st not in self._waiting and st in self._streams:
            self._waiting.append(st)

    def _remove(self, st: StreamState) -> None:
        self._release_slot(st)
        st.phase = Phase.CLOSED
        if st in self._streams:
            self._streams.remove(st)
        if st in self._waiting:
            self._waiting.remove(st)

    def _error(self, st: StreamState, err: StageError, close: bool = True) -> None:
        st.emit(ErrorOut(st.meta(), err))
        if close:
            self._remove(st)
            st.emit(ClosedOut(st.meta()))

    def _fail_all(self, err: StageError) -> None:
        for st in list(self._streams):
            try:
                self._error(st, err)
            except Exception:  # a broken emit must not stop the others from being told
                self._remove(st)

    def _maybe_finish_idle(self, st: StreamState) -> None:
        """End received and nothing left: close the turn (if any), send Done, close the stream."""
        if not st.ending:
            return
        if st.in_turn:
            self._finish_turn(st, "stop")
        if st.settings.duplex or st.turns_finished == 0:
            st.emit(DoneOut(st.meta(), "stop", st.session_frames, st.session_condition_rows))
        self._remove(st)
        st.emit(ClosedOut(st.meta()))

    # ------------------------------------------------------------------------------- segments
    def _start_segments(self, ready: list[StreamState]) -> None:
        """Start the next segment of each ready stream: their prefills run as one batched forward.

        A stream whose preparation fails gets its own error; if the batched forward itself fails, each
        stream is prefilled alone so that only the stream at fault gets the error.
        """
        items: list[tuple[StreamState, torch.Tensor]] = []
        for st in ready:
            prepared: list[torch.Tensor] = []
            self._guarded(st, functools.partial(self._prepare_into, out=prepared))
            if prepared:
                items.append((st, prepared[0]))
        if not items:
            return
        batch = [st for st, _ in items]
        try:
            logits = self.runner.prefill_batch([(st.slot, rows) for st, rows in items])  # type: ignore[misc]
        except Exception:
            for st, rows in items:
                self._guarded(st, functools.partial(self._prefill_alone, rows=rows))
            return
        PREFILL_BATCH.observe(len(batch))
        self._after_logits_batch(batch, logits)

    def _prepare_segment(self, st: StreamState) -> list[torch.Tensor]:
        """Take the next condition of ``st`` and build its context: ``[rows to prefill]``, or ``[]`` when the
        turn ends without a prefill (an empty whole-utterance condition)."""
        cond = st.queue.popleft()
        s = st.settings
        assert st.slot is not None
        if st.form is TurnForm.DUPLEX and cond.turn_id != st.turn_id:
            # the previous duplex turn never saw turn_end: close its windows, keep the slot for this one
            self._finish_turn(st, "stop", release_slot=False)
        if not st.in_turn:
            st.new_turn(cond.turn_id)
            self.runner.cache.reset(st.slot)
            if s.duplex:
                st.form = TurnForm.DUPLEX
            elif cond.is_last:
                st.form = TurnForm.WHOLE
            else:
                st.form = TurnForm.STREAMING
        elif st.form is TurnForm.WHOLE:
            raise StageError(FAILED_PRECONDITION, "chunk after the last chunk of the turn", "chunk")
        st.unit_seq = cond.unit_seq
        if st.form is TurnForm.WHOLE and cond.token_ids.numel() == 0:
            # Nothing to say (vllm-omni finishes such a request at once): no babble from an empty condition.
            self._finish_turn(st, "stop")
            return []
        model = self.model
        if st.form is TurnForm.WHOLE:
            rows = model.whole_utterance_condition(cond.token_ids, cond.hidden)
        elif st.form is TurnForm.STREAMING:
            rows = model.streaming_chunk_condition(cond.token_ids, cond.hidden, text_finished=cond.is_last)
        else:
            rows = model.duplex_unit_condition(cond.token_ids, cond.hidden)
        st.turn_condition_rows += int(cond.token_ids.numel())
        budget = (
            smp.duplex_budget(st.turn_segments == 0, cond.turn_end) if st.form is TurnForm.DUPLEX else None
        )
        context_rows = self._context_rows(st, rows, budget)
        st.seg_condition = rows
        st.seg_frames = []
        st.seg_t = 0
        st.seg_is_last = cond.is_last
        st.seg_turn_end = cond.turn_end
        st.seg_budget = budget
        st.pending_code = None
        if st.form is TurnForm.DUPLEX:
            assert st.row is not None
            st.row.clear_history()  # upstream generate_chunk counts only this unit's frames
        return [context_rows]

    def _context_rows(
        self, st: StreamState, rows: torch.Tensor, budget: smp.DuplexBudget | None
    ) -> torch.Tensor:
        """Decide what to prefill: append to the KV, or reset and recompute a one-chunk window."""
        assert st.slot is not None
        context = self.runner.context
        used = self.runner.cache.lengths[st.slot]
        if rows.shape[0] >= context:
            raise StageError(
                CONTEXT_LENGTH_EXCEEDED,
                f"condition of {rows.shape[0]} rows does not fit the Talker context of {context}",
                "token_ids",
            )
        recompute = False
        if st.form is TurnForm.STREAMING and st.turn_segments > 0:
            recompute = self.cfg.attention_type == "sliding_recompute"
            headroom = self.streaming_chunk_cap
            recompute = recompute or used + rows.shape[0] + headroom > context
        elif st.form is TurnForm.DUPLEX and st.turn_segments > 0:
            assert budget is not None
            recompute = used + rows.shape[0] + budget.max_samples > context  # rollover
        if not recompute:
            return rows
        self.runner.cache.reset(st.slot)
        parts = []
        if st.prev_condition is not None:
            parts.append(st.prev_condition)
            if st.prev_frames:
                parts.append(self.model.code_rows(torch.tensor(st.prev_frames, dtype=torch.long)))
        window = torch.cat([*parts, rows], dim=0) if parts else rows
        if window.shape[0] >= context:
            window = rows  # the previous chunk alone is too long to carry: keep only this condition
        return window

    # -------------------------------------------------------------------------------- decoding
    def _decode(self, batch: list[StreamState]) -> None:
        """One graphed decode+sample step for ``batch`` (or one block of K steps, :mod:`multistep`);
        only the picked ids come back to the host."""
        t0 = time.perf_counter()
        if self.runner.blocks is not None:
            multistep.decode_block(self, batch)
            self._observe_step(batch, t0)
            return
        vocab = self.cfg.num_audio_tokens
        slots: list[int] = []
        codes: list[int] = []
        packed: list[tuple[list[int], list[float]]] = []
        for st in batch:
            slots.append(st.slot)  # type: ignore[arg-type]
            codes.append(st.pending_code)  # type: ignore[arg-type]
            st.pending_code = None
            packed.append(smp.pack_row(st.row, self._rules(st), vocab))  # type: ignore[arg-type]
        observer = self.logits_observer
        ids, logits = self.runner.decode_sample(slots, codes, packed, want_logits=observer is not None)
        if observer is not None:
            assert logits is not None
            for i, st in enumerate(batch):
                observer(st, logits[i])
        for st, code in zip(batch, ids, strict=True):
            self._guarded(st, functools.partial(self._on_sample, code=code))
        self._observe_step(batch, t0)

    def _observe_step(self, batch: list[StreamState], t0: float) -> None:
        self._batch_size.observe(len(batch))
        DECODE_ROWS.set(len(batch))
        self._step_seconds.observe(time.perf_counter() - t0)

    def _after_logits(self, st: StreamState, logits: torch.Tensor) -> None:
        self._after_logits_batch([st], logits)

    def _rules(self, st: StreamState, ahead: int = 0) -> smp.StepRules:
        """The sampler rules of ``st``'s next sample, or of the one ``ahead`` samples later if the segment
        goes on (each continuing sample adds one frame to the segment and to the turn)."""
        s = st.settings
        t = st.seg_t + ahead
        if st.form is TurnForm.WHOLE:
            return smp.whole_utterance_rules(t, s.min_new_frames, never_stop=s.fixed_frames > 0)
        if st.form is TurnForm.STREAMING:
            return smp.streaming_chunk_rules(st.turn_frames + ahead, t)
        assert st.seg_budget is not None
        return smp.duplex_rules(t, st.seg_budget)

    def _after_logits_batch(self, batch: list[StreamState], logits: torch.Tensor) -> None:
        """Sample after a prefill (eager, same :func:`sampling.sample_packed` the decode graph runs)."""
        if self.logits_observer is not None:
            for i, st in enumerate(batch):
                self.logits_observer(st, logits[i])
        rows = [st.row for st in batch]
        rules = [self._rules(st) for st in batch]
        ints, floats = smp.pack_rows(rows, rules, logits.shape[-1])  # type: ignore[arg-type]
        dev = logits.device
        picked = smp.sample_packed(
            logits, to_device(ints, dev), to_device(floats, dev), self.eos, self.runner.vocab_salt
        )
        for st, code in zip(batch, picked.tolist(), strict=True):
            self._guarded(st, functools.partial(self._on_sample, code=code))

    def _prepare_into(self, st: StreamState, out: list[torch.Tensor]) -> None:
        out.extend(self._prepare_segment(st))

    def _prefill_alone(self, st: StreamState, rows: torch.Tensor) -> None:
        assert st.slot is not None  # a prepared stream holds a slot
        self._after_logits(st, self.runner.prefill(st.slot, rows)[None])

    def _on_sample(self, st: StreamState, code: int) -> None:
        s = st.settings
        t = st.seg_t
        st.seg_t += 1
        assert st.slot is not None and st.row is not None
        cache_full = self.runner.cache.lengths[st.slot] >= self.runner.context
        if st.form is TurnForm.DUPLEX:
            assert st.seg_budget is not None
            if t >= st.seg_budget.max_samples - 1 or code == self.eos:
                self._end_segment(st)  # the unit's last sample is dropped, as upstream does
                return
            self._keep(st, code)
            if cache_full:
                self._end_segment(st)
            else:
                st.pending_code = code
                st.phase = Phase.DECODE
            return
        if code == self.eos:
            self._end_segment(st)
            return
        self._keep(st, code)
        if st.form is TurnForm.WHOLE:
            limit = s.fixed_frames if s.fixed_frames else s.max_new_frames
            if st.turn_frames >= limit:
                self._finish_turn(st, "stop" if s.fixed_frames else "length")
                return
            if cache_full:
                self._finish_turn(st, "length")
                return
        else:  # streaming chunk
            if st.turn_frames >= s.max_new_frames:
                self._drop_rest_of_turn(st)
                self._finish_turn(st, "length")
                return
            if st.seg_t >= self.streaming_chunk_cap or cache_full:
                self._end_segment(st)  # the last frame stays unfed, as upstream's 500-sample cap leaves it
                return
        st.pending_code = code
        st.phase = Phase.DECODE

    def _keep(self, st: StreamState, code: int) -> None:
        assert st.row is not None and st.windower is not None
        st.row.remember(code)
        st.seg_frames.append(code)
        st.turn_frames += 1
        self.frames_emitted += 1
        FRAMES.inc()
        for w in st.windower.push([code]):
            st.emit(WindowOut(st.meta(), w))

    @staticmethod
    def _drop_rest_of_turn(st: StreamState) -> None:
        """A streaming turn ended on its frame budget: its queued chunks, and those still to come up to its
        last one, are not spoken. Without this each of them started a turn of its own after the Done,
        decoding frames nobody reads (the gateway stops at the turn's Done)."""
        while st.queue:
            if st.queue.popleft().is_last:
                return
        st.skip_to_last = True

    def _end_segment(self, st: StreamState) -> None:
        """A chunk/unit finished (EOS, budget or cap); the whole utterance finishes its turn here."""
        st.phase = Phase.IDLE
        st.pending_code = None
        st.prev_condition = st.seg_condition
        st.prev_frames = list(st.seg_frames)
        first_segment = st.turn_segments == 0
        st.turn_segments += 1
        if st.form is TurnForm.WHOLE:
            self._finish_turn(st, "stop")
        elif st.form is TurnForm.STREAMING:
            if st.seg_is_last:
                self._finish_turn(st, "stop")
        else:
            assert st.windower is not None
            if st.seg_turn_end:
                self._finish_turn(st, "stop")
            elif first_segment:
                for w in st.windower.flush_partial():  # upstream force_flush at turn start
                    st.emit(WindowOut(st.meta(), w))

    def _finish_turn(self, st: StreamState, reason: str, release_slot: bool = True) -> None:
        """Final window (is_last) and Done for turn mode; duplex sends only the final window per turn."""
        assert st.windower is not None
        st.emit(WindowOut(st.meta(), st.windower.finish()))
        st.turns_finished += 1
        st.session_frames += st.turn_frames
        st.session_condition_rows += st.turn_condition_rows
        if st.form is not TurnForm.DUPLEX:
            st.emit(DoneOut(st.meta(), reason, st.turn_frames, st.turn_condition_rows))
        st.form = None
        st.phase = Phase.IDLE
        st.pending_code = None
        if release_slot:
            self._release_slot(st)

    # ----------------------------------------------------------------------------------- drain
    def idle(self) -> bool:
        return not self._streams and self._inbox.empty()

    def request_cancel_all(self) -> None:
        """Thread-safe: ask the engine loop to cancel every stream at its next step."""
        self._cancel_all.set()
        self._wake.set()

    def cancel_all(self, reason: str = "cancelled") -> None:
        """Drain deadline passed (engine thread): tell every stream it was cancelled and drop it."""
        for st in list(self._streams):
            st.emit(DoneOut(st.meta(), reason, st.turn_frames, st.turn_condition_rows))
            self._remove(st)
            st.emit(ClosedOut(st.meta()))
