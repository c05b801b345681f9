"""The thinker engine loop: takes work from streams, steps the model, hands tokens and hidden rows back.

Threading model: one engine thread per device owns the scheduler, the KV cache and the runner. Streams
(the asyncio gRPC front, or tests) talk to it only through a command queue (:meth:`ThinkerEngine.submit`,
:meth:`cancel`, :meth:`close`) and receive :class:`EngineEvent` objects through the per-sequence sink
callback, which runs on the engine thread and must not block (a stream's sink is
:meth:`services.common.stage_stream.Inbox.post_threadsafe`, which hands the event to the event loop). Tests can instead drive :meth:`step` synchronously.

A step: drain commands → ask the scheduler for a plan → run it → sample every row that ends a prompt or
decodes → emit events → update metrics. Errors are typed (:class:`StageError`) and go to the affected
sequence only.

Size: a little over 500 lines on purpose: the overlapped decode (:mod:`services.thinker.overlap`) has to
interleave with the step, the command drain and the consumer, which live here; its rules and launch
code are in that module and the metrics in :mod:`services.thinker.engine_metrics`.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL,
    RESOURCE_EXHAUSTED,
    StageError,
)
from services.common.memory_watch import MemoryWatch
from services.common.metrics import IN_FLIGHT, INTERRUPT_DRAIN, QUEUE_DEPTH
from services.common.slow_steps import StepTimer
from services.thinker.engine_metrics import (
    KV_BUDGET_BYTES,
    KV_USED_BYTES,
    PREFIX_CACHED_BLOCKS,
    PREFIX_EVICTIONS,
    PREFIX_HITS,
    PREFIX_MISSES,
    RUNNING,
    SESSIONS,
    STAGE,
    TTFT,
    observe_step,
)
from services.thinker.errors import failure
from services.thinker.kv_cache import (
    KVLayout,
    PagedKVCache,
    check_explicit_kv_budget,
    default_kv_budget,
    kv_cache_dtype,
)
from services.thinker.overlap import (
    InFlight,
    Prefetched,
    chain_rows,
    copy_to_host,
    deferrable,
    launch_successor,
    settle,
)
from services.thinker.runner import DecodeRow, ModelRunner, PrefillChunk, StepInput
from services.thinker.sampling import Sampler, choose_tokens
from services.thinker.scheduler import Scheduler, SeqStatus, Sequence, StepPlan, WorkItem
from services.thinker.step_types import StepOutput

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_context: int = 40960
    max_num_seqs: int = 64
    max_step_tokens: int = 512
    block_size: int = 16
    kv_budget_bytes: int | None = None  # wins over memory_fraction
    # Per-process GPU memory cap in force (set by the CLI); sizes the KV pool when kv_budget_bytes is None.
    memory_fraction: float | None = None
    memory_fraction_key: str = "stages.thinker.memory_fraction"  # what the budget error tells to change
    # Device memory that per-stream state allocated later will hold outside the KV pool (the duplex
    # sessions' Whisper caches); a default budget leaves it free.
    reserve_bytes: int = 0
    use_cuda_graphs: bool = True
    compile_layers: bool = False  # torch.compile the per-layer norm/rotary/MLP blocks (GPU throughput)
    # Graphed decode steps without RMSNorm kernels: the norm weights folded into the QKV and gate|up GEMMs,
    # residual adds inside the O and down GEMMs (services.thinker.fused_forward). None: on with CUDA and
    # the Triton kernels.
    norm_fold: bool | None = None
    # Projection weights (QKV, O, gate|up, down, lm_head): "bf16" (the checkpoint's dtype) or "fp8" (e4m3,
    # per-channel scales, quantized at load: services.thinker.fp8_weights).
    weights: str = "bf16"
    # The KV cache: "bf16" (the model's dtype) or "fp8" (e4m3 with no scale, services.thinker.kv_cache):
    # half the bytes per token, so a decode step reads half the K/V and the pool holds twice the tokens.
    kv_cache: str = "bf16"
    # The process's GIL switch interval while the engine thread runs (None: Python's 5 ms). Each CUDA sync
    # of a step drops the GIL; getting it back from a thread busy in pure Python (the event loop encoding
    # protobufs, the encode thread's mel) takes up to one interval, so at 5 ms a step's two syncs could
    # cost ~10 ms of host time with 16 duplex sessions. At 1 ms a wait costs ~0.5 ms (measured on CPU).
    gil_switch_interval_s: float | None = 0.001
    # Launch the next decode step before reading this one's tokens (services.thinker.overlap): greedy,
    # grammar and plain temperature rows, chosen on the device; only graph steps qualify.
    overlap_decode: bool = True
    # Automatic prefix caching: full KV blocks shared by content hash across sequences
    # (services.thinker.scheduler); the deploy profile's stages.thinker.prefix_caching turns it off.
    prefix_caching: bool = True


@dataclass
class EngineEvent:
    """What one step did for one sequence. ``hidden`` is the final-norm row of ``fed_token`` (CPU)."""

    seq_id: int
    tag: object = None
    token: int | None = None
    fed_token: int | None = None
    hidden: torch.Tensor | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled", "prefilled"
    error: StageError | None = None
    context_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # With logprobs requested: (chosen token's logprob, [(id, logprob)] best first).
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
    # Prefill rows a work item asked for (``WorkItem.export_from``): ids and their hidden rows (CPU).
    prompt_row_ids: list[int] | None = None
    prompt_rows: torch.Tensor | None = None
    cached_tokens: int = 0  # prompt tokens of the work item found in the prefix cache (not computed)


Sink = Callable[[EngineEvent], None]


def _device_ms(events: tuple[torch.cuda.Event, torch.cuda.Event]) -> str:
    """The time between two recorded CUDA events in ms, or "pending" while the second has not run."""
    return f"{events[0].elapsed_time(events[1]):.1f}" if events[1].query() else "pending"


class ThinkerEngine:
    """Continuous batching over a paged KV cache for any number of streams."""

    MAX_STEP_FAILURES = 3  # consecutive failed iterations after which every stream is ended

    def __init__(self, llm: torch.nn.Module, config: EngineConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        # transformers' Qwen3ForCausalLM and its config, read by attribute name (typed loosely).
        qwen: Any = llm
        cfg = qwen.config
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        dtype: torch.dtype = qwen.model.embed_tokens.weight.dtype
        self.layout = KVLayout(
            int(cfg.num_hidden_layers),
            int(cfg.num_key_value_heads),
            head_dim,
            kv_cache_dtype(config.kv_cache, dtype),
            config.block_size,
        )
        self.max_context = min(int(config.max_context), int(cfg.max_position_embeddings))
        budget = config.kv_budget_bytes
        budget_is_auto = budget is None
        if budget is not None:
            check_explicit_kv_budget(
                budget, self.device, config.memory_fraction, config.memory_fraction_key, config.reserve_bytes
            )
        else:
            budget = self._auto_kv_budget(config)
        self.cache = PagedKVCache(self.layout, budget, self.device, prefix_caching=config.prefix_caching)
        self.runner = ModelRunner(
            llm,
            self.cache,
            use_cuda_graphs=config.use_cuda_graphs,
            compile_layers=config.compile_layers,
            norm_fold=config.norm_fold,
            weights=config.weights,
        )
        if budget_is_auto and config.weights == "fp8" and self.device.type == "cuda":
            self._resize_pool_to_quantized_weights(config)
        self.scheduler = Scheduler(
            self.cache.pool,
            self.layout,
            max_context=self.max_context,
            max_num_seqs=config.max_num_seqs,
            max_step_tokens=config.max_step_tokens,
        )
        self.hidden_size = int(cfg.hidden_size)
        self._commands: queue.SimpleQueue[tuple[str, Sequence, WorkItem | None, float]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sequences: dict[int, Sequence] = {}
        # Persistent sequences opened and not yet closed (duplex sessions), by id. Touched only by the
        # callers of open/close (the server's event loop), never by the engine thread.
        self._open_sessions: set[int] = set()
        self.max_kv_used_bytes = 0  # high-water mark, for tests and capacity planning
        self._pending_metrics: tuple | None = None  # the last step's, observed after the next launch
        self.overlap = config.overlap_decode
        self._inflight: InFlight | None = None  # a launched decode step whose tokens are not consumed yet
        self._timer = StepTimer("thinker")  # logs a step slower than slow_step_ms with its phases
        self._memory = MemoryWatch("thinker", self.device)  # allocator gauges, high-water log lines
        self.chained_steps = 0  # steps launched before their predecessor was consumed (tests, bench)
        KV_BUDGET_BYTES.set(self.cache.budget_bytes)
        self._exported = (0, 0, 0)  # prefix hits, misses, evictions already added to the counters
        self._update_gauges()

    def _auto_kv_budget(self, config: EngineConfig) -> int:
        """The KV pool's bytes when no ``--kv-budget`` is given (:func:`default_kv_budget`)."""
        return default_kv_budget(
            self.layout,
            self.device,
            self.max_context,
            min(config.max_num_seqs, 8),
            memory_fraction=config.memory_fraction,
            memory_fraction_key=config.memory_fraction_key,
            reserve_bytes=config.reserve_bytes,
        )

    def _resize_pool_to_quantized_weights(self, config: EngineConfig) -> None:
        """Size the automatic KV pool again once fp8 weights are in place.

        The pool is sized while the checkpoint's bf16 weights are resident; the runner then quantizes them
        to fp8 and releases the bf16 tensors, about half the weight bytes. Sized again by the same rule
        (the memory cap or the free memory, minus the headroom), the pool takes those bytes: more
        sequences and longer contexts on the same card. The pool is still empty here and no CUDA graph
        has been captured, so the old storage is dropped before the new one is allocated.
        """
        before = self.cache.budget_bytes
        self.cache.k.clear()
        self.cache.v.clear()
        torch.cuda.empty_cache()
        budget = self._auto_kv_budget(config)
        self.cache = PagedKVCache(self.layout, budget, self.device, prefix_caching=config.prefix_caching)
        self.runner.cache = self.cache
        log.info("thinker KV pool resized for fp8 weights: %.2f -> %.2f GiB", before / 2**30, budget / 2**30)

    # ------------------------------------------------------------------------------------ public API
    def open(self, sink: Sink, *, persistent: bool = False) -> Sequence:
        """A new KV owner. Turn requests are one-shot; duplex sessions are ``persistent``."""
        seq = Sequence(persistent=persistent, sink=sink)
        if persistent:
            self._open_sessions.add(seq.seq_id)
        return seq

    def submit(self, seq: Sequence, work: WorkItem) -> None:
        """Append ``work`` to ``seq`` (validated on the engine thread; failures arrive as error events)."""
        self._command("submit", seq, work)

    def cancel(self, seq: Sequence) -> None:
        """Stop the current work item; a persistent sequence keeps the KV of what it already fed."""
        self._command("cancel", seq, None)

    def close(self, seq: Sequence) -> None:
        """Drop the sequence and free its KV on the next engine iteration (at most one step away)."""
        self._open_sessions.discard(seq.seq_id)
        self._command("close", seq, None)

    @property
    def open_sessions(self) -> int:
        return len(self._open_sessions)

    def session_share(self) -> int:
        """Context tokens one duplex session may hold, its next unit's reservation included.

        Why: a duplex session keeps its KV between units and never finishes on its own, so sessions that
        together outgrow the pool wait for blocks that nobody gives back, and every one of them stalls
        (24 sessions on an H100's 8 GiB pool did after about 50 s). An equal share of the pool per open
        session, with one share left over for chat requests and in-flight work, keeps the sum of what
        the sessions hold within the pool: a session past its share trims its context window (or ends
        with RESOURCE_EXHAUSTED when it has none). One block per session is kept for the partly filled
        last block.
        """
        tokens = self.cache.capacity_tokens // (len(self._open_sessions) + 1)
        return max(0, tokens - self.layout.block_size)

    def check_prompt_length(self, num_tokens: int, param: str = "messages") -> None:
        """Raise the stable context error before any work is queued for an over-long prompt."""
        if num_tokens > self.max_context:
            raise StageError(
                CONTEXT_LENGTH_EXCEEDED,
                f"prompt has {num_tokens} tokens; the thinker context is {self.max_context}",
                param,
            )

    @property
    def kv_used_bytes(self) -> int:
        return self.cache.used_bytes

    def is_idle(self) -> bool:
        return (
            self._inflight is None
            and not self.scheduler.running
            and not self.scheduler.waiting
            and self._commands.empty()
        )

    # ---------------------------------------------------------------------------------------- thread
    def start(self) -> None:
        if self._thread is not None:
            return
        if self.config.gil_switch_interval_s is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        self._thread = threading.Thread(target=self._loop, name="thinker-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                did = self.step()
                failures = 0
            except Exception as exc:  # step() ends the sequences of a failed forward or sampling itself
                log.exception("thinker engine step failed")
                failures += 1
                if failures >= self.MAX_STEP_FAILURES:
                    # Something outside one plan keeps failing: end every stream with the error rather
                    # than spin on it with their clients waiting.
                    self._inflight = None
                    everyone = StepPlan(decode=[*self.scheduler.running, *self.scheduler.waiting])
                    self._fail_plan(everyone, "thinker engine step failed repeatedly", exc)
                    failures = 0
                did = False
            if not did:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _command(self, kind: str, seq: Sequence, work: WorkItem | None) -> None:
        self._commands.put((kind, seq, work, time.perf_counter()))
        self._wake.set()

    # ------------------------------------------------------------------------------------------ step
    def step(self) -> bool:
        """One engine iteration; returns False when there was nothing to do. A slow one is logged with
        its phases (:mod:`services.common.slow_steps`)."""
        self._timer.start()
        try:
            return self._step()
        finally:
            self._timer.finish()

    def _step(self) -> bool:
        """The body of :meth:`step`.

        The previous step's metrics and the gauges are written after this step's forward is launched,
        while the device computes it: written before, they would sit between the previous step's token
        sync and this launch, with the device idle (the host work per step that bench.thinker reports).

        With overlap (:mod:`services.thinker.overlap`) a decode step whose rows are all chosen on the
        device (greedy, grammar-masked, plain draws) is left in flight: the next call launches its
        successor from the device-side tokens, then consumes it. Commands and every other plan change
        apply only once the in-flight step is consumed.
        """
        consumed = False
        if self._inflight is not None:
            if self._chain():
                return True
            inf_plan = self._inflight.plan
            try:
                self._consume_inflight()
            except Exception as exc:
                self._fail_plan(inf_plan, "reading a thinker step's tokens failed", exc)
            self._timer.mark("consume in-flight")
            consumed = True
        self._drain_commands()
        plan = self.scheduler.plan()
        self._timer.mark("commands and plan")
        if plan.empty:
            self._flush_step_metrics()
            self._update_gauges()
            return consumed
        t0 = time.perf_counter()
        events = self._forward_events()
        try:
            out = self.runner.step(self._step_input(plan))
        except Exception as exc:
            self._fail_plan(plan, "thinker forward failed", exc)
            return True
        if events is not None:
            events[1].record()
        t_forward = time.perf_counter() - t0
        n_prefill = sum(n for _, n in plan.prefill)
        # On CUDA this phase is the launch; the device's own forward time shows in "sample and emit".
        phase = "forward" if events is None else "forward launch"
        self._timer.mark(phase, decode_rows=len(plan.decode), prefill_tokens=n_prefill)
        self._flush_step_metrics()
        self._update_gauges()
        try:
            self._finish_step(plan, out, events, t0, t_forward, n_prefill)
        except Exception as exc:
            # Sampling or emitting failed (device memory, a grammar): the same plan would fail again on
            # the next iteration, so its sequences end now with a typed error and the others go on.
            self._inflight = None
            self._fail_plan(plan, "thinker sampling failed", exc)
        return True

    def _finish_step(
        self,
        plan: StepPlan,
        out: StepOutput,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
        t0: float,
        t_forward: float,
        n_prefill: int,
    ) -> None:
        """After a launched forward: leave a deferrable decode step in flight, or consume it now."""
        if self.overlap and self.runner.use_cuda_graphs and deferrable(plan, out):
            assert out.greedy_tokens is not None
            emit = any(s.work is not None and s.work.emit_hidden for s in plan.decode)
            works = [s.work for s in plan.decode]
            positions = [len(s.tokens) for s in plan.decode]
            inf = InFlight(
                plan,
                works,  # type: ignore[arg-type]
                positions,
                out.greedy_tokens,
                out.decode_logits,
                out.decode_hidden if emit else None,
            )
            settle(inf)  # grammar masks and draws queued behind the replay, then the tokens' copy
            self._inflight = inf
            self._pending_metrics = (
                events, t_forward, time.perf_counter() - t0, 0, len(plan.decode), 0, self.runner.last_path
            )  # fmt: skip
            return
        self._consume(plan, out)
        if events is None:
            self._timer.mark("sample and emit")
        else:  # its wall time includes waiting for the device: say how much of it the forward took
            self._timer.mark("sample and emit", device_forward_ms=lambda: _device_ms(events))
        dt = time.perf_counter() - t0
        self._pending_metrics = (
            events, t_forward, dt, n_prefill, len(plan.decode), len(plan.prefill), self.runner.last_path
        )  # fmt: skip

    def _fail_plan(self, plan: StepPlan, what: str, exc: BaseException) -> None:
        """End every sequence of ``plan`` with a typed error (device out of memory is RESOURCE_EXHAUSTED)
        and free its KV: a step that raised would raise again if planned again, and the engine must
        neither spin on it nor leave its streams waiting."""
        log.error("%s; ending its %d sequence(s)", what, len(plan.decode) + len(plan.prefill), exc_info=exc)
        err = failure(what, exc)
        for seq in {*plan.decode, *(s for s, _ in plan.prefill)}:
            if seq.seq_id in self._sequences:
                self._emit(seq, EngineEvent(seq.seq_id, error=err))
            self._drop(seq)

    def _forward_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """On CUDA the forward is asynchronous: its time is read from a pair of events (the first recorded
        now) once sampling has synced; None on the CPU, where the wall time is the forward's."""
        if self.device.type != "cuda":
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        return events

    def _chain(self) -> bool:
        """Launch the in-flight step's successor from its device-side tokens, consume the in-flight step,
        then queue the successor's choice (grammar masks filled now, one step behind) and copy."""
        inf = self._inflight
        assert inf is not None
        if "step" in vars(self.runner):
            return False  # a tap wraps runner.step (duplex dumps) and must see every step
        rows = chain_rows(inf, self.scheduler, self.max_context, not self._commands.empty())
        if rows is None:
            return False
        t0 = time.perf_counter()
        events = self._forward_events()
        try:
            nxt = launch_successor(self.runner, inf, rows)
        except Exception:
            log.exception("chained thinker step failed; consuming synchronously")
            return False
        if nxt is None:
            return False
        if events is not None:
            events[1].record()
        t_forward = time.perf_counter() - t0
        self._timer.mark("chained forward", decode_rows=len(rows))
        self._flush_step_metrics()
        self._update_gauges()
        self._consume_inflight()
        self._timer.mark("consume in-flight")
        try:
            settle(nxt)
        except Exception:
            # Nothing of step n+1 was consumed and no grammar took a token: its rows are planned again
            # from their next token (the replay rewrites the same key/value positions).
            log.exception("choosing a chained thinker step's tokens failed; planning it again")
            return True
        self._inflight = nxt
        self.chained_steps += 1
        self._pending_metrics = (events, t_forward, time.perf_counter() - t0, 0, len(rows), 0, "graph")
        return True

    def _consume_inflight(self) -> None:
        """Read the in-flight step's tokens and handle them for the rows still running its work."""
        inf, self._inflight = self._inflight, None
        assert inf is not None and inf.host is not None
        inf.host.wait()
        live = inf.alive()
        plan, host = inf.plan, inf.host
        if len(live) != len(plan.decode):  # rows that stopped one step earlier: their result is dropped
            plan, host = StepPlan(decode=[plan.decode[i] for i in live]), host.rows(live)
        if plan.decode:
            self._consume(plan, inf.output(), host)

    def _flush_step_metrics(self) -> None:
        """Observe the last step's split, token counts and rates (deferred, see :meth:`step`)."""
        pending, self._pending_metrics = self._pending_metrics, None
        if pending is not None:
            observe_step(*pending)

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        """Synchronous driver for tests and offline use."""
        for _ in range(max_steps):
            if not self.step() and self.is_idle():
                return
        raise RuntimeError("engine did not become idle")

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, seq, work, submitted = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind in ("cancel", "close") and seq.work is not None:
                # Commands apply between steps: the wait is how long the old work's last step still ran.
                INTERRUPT_DRAIN.labels("thinker").observe(time.perf_counter() - submitted)
            elif kind == "cancel":
                INTERRUPT_DRAIN.labels("thinker").observe(0.0)
            if kind == "submit":
                assert work is not None
                self._accept(seq, work)
            elif kind == "cancel":
                if seq.work is not None:
                    tag = seq.work.tag
                    self.scheduler.end_work(seq)
                    self._emit(seq, EngineEvent(seq.seq_id, tag=tag, finish_reason="cancelled"))
            elif kind == "close":
                self._drop(seq)

    def _accept(self, seq: Sequence, work: WorkItem) -> None:
        if seq.status is SeqStatus.FINISHED:
            return  # closed before its work arrived
        if seq.work is not None:
            err = StageError(INTERNAL, "a work item is already running on this sequence")
            self._emit(seq, EngineEvent(seq.seq_id, tag=work.tag, error=err))
            return
        total = len(seq.tokens) + len(work.token_ids)
        if total > self.max_context or (work.sampler is not None and total >= self.max_context):
            err = StageError(
                CONTEXT_LENGTH_EXCEEDED,
                f"context would hold {total} tokens; the thinker context is {self.max_context}",
                "messages",
            )
            self._emit(seq, EngineEvent(seq.seq_id, tag=work.tag, error=err, context_tokens=len(seq.tokens)))
            return
        want = min(total + (work.sampler.reserve_tokens if work.sampler else 0), self.max_context)
        if not self.scheduler.can_ever_fit(want):
            err = StageError(
                RESOURCE_EXHAUSTED,
                f"request needs KV for {want} tokens; the KV budget holds {self.cache.capacity_tokens}",
                "sampling.max_tokens",
            )
            self._emit(seq, EngineEvent(seq.seq_id, tag=work.tag, error=err, context_tokens=len(seq.tokens)))
            return
        self._sequences[seq.seq_id] = seq
        self.scheduler.enqueue(seq, work)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.free(seq)
        self._sequences.pop(seq.seq_id, None)

    def _step_input(self, plan: StepPlan) -> StepInput:
        inp = StepInput()
        for seq in plan.decode:
            assert seq.next_token is not None
            inp.decode.append(DecodeRow(seq.next_token, len(seq.tokens), seq.blocks))
        for seq, n in plan.prefill:
            assert seq.work is not None
            embeds = None
            if seq.prompt_embeds is not None and seq.prompt_offset < seq.prompt_embeds.shape[0]:
                # The rows the work item embeds, which may cover only the chunk's first rows (a
                # registered voice's prefix): the rest are text rows the runner embeds from their ids.
                embeds = seq.prompt_embeds[seq.prompt_offset : seq.prompt_offset + n]
            finishes_prompt = n == len(seq.prompt)
            export = seq.work.export_from
            inp.prefill.append(
                PrefillChunk(
                    seq.prompt[:n],
                    len(seq.tokens),
                    seq.blocks,
                    embeds=embeds,
                    want_logits=finishes_prompt and seq.work.sampler is not None,
                    want_hidden=export is not None and seq.prompt_offset + n > export,
                )
            )
        return inp

    # --------------------------------------------------------------------------------- after forward
    def _consume(self, plan: StepPlan, out, host: Prefetched | None = None) -> None:  # noqa: ANN001 (StepOutput)
        """Sample, emit and finish the rows of a step; ``host``: a deferred step's prefetched tokens (chosen
        on the device, :func:`services.thinker.overlap.settle`) and hidden rows (``out`` carries no logits)."""
        to_sample: list[tuple[Sequence, torch.Tensor | None, int | None, torch.Tensor | None]] = []
        finishing: list[tuple[Sequence, EngineEvent]] = []
        greedy_index: list[int] = []  # row of out.greedy_tokens for each row sampled
        hidden_cpu, hidden_ready = None, None
        if host is not None:
            hidden_cpu = host.hidden
        elif plan.decode and any(s.work is not None and s.work.emit_hidden for s in plan.decode):
            hidden_cpu, hidden_ready = copy_to_host(out.decode_hidden)
        for i, seq in enumerate(plan.decode):
            fed = seq.next_token
            assert fed is not None and seq.work is not None
            seq.tokens.append(fed)
            seq.next_token = None
            self.scheduler.commit_blocks(seq)
            row = hidden_cpu[i] if hidden_cpu is not None and seq.work.emit_hidden else None
            if seq.finishing is not None:  # emitted once the rows have landed (below)
                finishing.append((seq, EngineEvent(seq.seq_id, fed_token=fed, hidden=row)))
                continue
            to_sample.append((seq, None if host is not None else out.decode_logits[i], fed, row))
            greedy_index.append(i)
        k = len(plan.decode)
        prefill_hidden = out.prefill_hidden or [None] * len(plan.prefill)
        for (seq, n), logits, rows in zip(plan.prefill, out.prefill_logits, prefill_hidden, strict=True):
            assert seq.work is not None
            k += logits is not None
            if rows is not None and seq.work.export_from is not None:
                self._export_rows(seq, n, rows)
            seq.tokens.extend(seq.prompt[:n])
            seq.prompt = seq.prompt[n:]
            seq.prompt_offset += n
            self.scheduler.commit_blocks(seq)
            if seq.prompt:
                continue
            seq.prompt_embeds = None
            if seq.work.sampler is None:
                self._finish(seq, EngineEvent(seq.seq_id), "prefilled")
            else:
                assert logits is not None
                to_sample.append((seq, logits, None, None))
                greedy_index.append(k - 1)
        tokens: list[int] = []
        samplers: list[Sampler] = []
        for s, _, _, _ in to_sample:
            assert s.work is not None and s.work.sampler is not None  # only sampling rows were queued
            samplers.append(s.work.sampler)
        if host is not None:
            picked = host.tokens.tolist()
            tokens = [int(picked[j]) for j in greedy_index]
            for sampler, token in zip(samplers, tokens, strict=True):
                sampler.accept(token)  # the grammar takes the token its mask chose on the device
        elif to_sample and out.greedy_tokens is not None and all(s.batchable_greedy for s in samplers):
            # The graph's own argmax: the step's sync is this read-back of B ids, nothing is launched.
            picked = out.greedy_tokens.tolist()
            tokens = [int(picked[j]) for j in greedy_index]
        elif to_sample:
            # The step's sync: the hidden rows' copy was queued before it, and constrained rows' grammar
            # masks are filled on the host first, while the device still runs this step.
            tokens = choose_tokens(
                samplers,
                torch.stack([lg for _, lg, _, _ in to_sample if lg is not None]),
                [s.tokens for s, _, _, _ in to_sample],
                [len(s.generated) for s, _, _, _ in to_sample],
            )
        if hidden_ready is not None:
            hidden_ready.synchronize()  # already done when sampling synced; waits only if nothing was sampled
        for seq, ev in finishing:
            assert seq.finishing is not None
            self._finish(seq, ev, seq.finishing)
        if not to_sample:
            return
        now = time.perf_counter()
        for (seq, _, fed, row), token, sampler in zip(to_sample, tokens, samplers, strict=True):
            if seq.first_token_at is None:
                seq.first_token_at = now
                TTFT.observe(now - seq.submitted_at)
            seq.generated.append(token)
            reason = sampler.finish_reason(token, len(seq.generated))
            if reason is None and len(seq.tokens) >= self.max_context:
                reason = "length"
            ev = EngineEvent(
                seq.seq_id, token=token, fed_token=fed, hidden=row, logprobs=sampler.last_logprobs
            )
            if reason is None:
                seq.next_token = token
                self._emit(seq, ev)
            elif reason == "length" and seq.work.feed_last and len(seq.tokens) < self.max_context:  # type: ignore[union-attr]
                seq.next_token = token  # one more forward for the row of this last token
                seq.finishing = reason
                self._emit(seq, ev)
            else:
                self._finish(seq, ev, reason)

    def _export_rows(self, seq: Sequence, n: int, rows: torch.Tensor) -> None:
        """Emit the hidden rows of this prefill chunk that lie at or after ``work.export_from``."""
        assert seq.work is not None and seq.work.export_from is not None
        skip = max(0, seq.work.export_from - seq.prompt_offset)
        if skip >= n:
            return
        ids = seq.prompt[skip:n]
        host = rows[skip:n].to("cpu", copy=True)
        self._emit(seq, EngineEvent(seq.seq_id, prompt_row_ids=list(ids), prompt_rows=host))

    def _finish(self, seq: Sequence, ev: EngineEvent, reason: str) -> None:
        ev.finish_reason = reason
        self._emit(seq, ev)
        if seq.persistent:
            self.scheduler.end_work(seq)
        else:
            self._drop(seq)

    def _emit(self, seq: Sequence, ev: EngineEvent) -> None:
        if seq.work is not None:
            ev.tag = seq.work.tag if ev.tag is None else ev.tag
            ev.prompt_tokens = len(seq.work.token_ids)
            ev.cached_tokens = seq.cached_tokens
        ev.completion_tokens = len(seq.generated)
        ev.context_tokens = len(seq.tokens)
        if seq.sink is not None:
            try:
                seq.sink(ev)
            except Exception:
                log.exception("thinker sink failed for sequence %d", seq.seq_id)

    def _update_gauges(self) -> None:
        used = self.cache.used_bytes
        self.max_kv_used_bytes = max(self.max_kv_used_bytes, used)
        KV_USED_BYTES.set(used)
        QUEUE_DEPTH.labels(STAGE).set(self.scheduler.queue_depth)
        RUNNING.set(len(self.scheduler.running))
        IN_FLIGHT.labels(STAGE).set(len(self.scheduler.running) + self.scheduler.queue_depth)
        SESSIONS.set(len(self._sequences))
        sched, pool = self.scheduler, self.cache.pool
        now = (sched.hit_tokens, sched.miss_tokens, pool.evictions)
        if now != self._exported:
            for counter, new, old in zip(
                (PREFIX_HITS, PREFIX_MISSES, PREFIX_EVICTIONS), now, self._exported, strict=True
            ):
                if new > old:
                    counter.inc(new - old)
            self._exported = now
        PREFIX_CACHED_BLOCKS.set(pool.cached_blocks)
        self._memory.check()
