"""Asyncio scheduler of the Code2Wav stage: streams submit windows, one worker thread runs batches.

Every open stream owns a :class:`StreamHandle` (its voice, seed, epoch, validation cursor, model state
and a queue of pending windows). The scheduler loop takes the oldest pending window of every stream that
is not already in flight (at most ``max_batch``), hands them to :meth:`Code2WavRunner.run` on a single
worker thread (the runner stacks windows of equal shape into one batch), and routes each result back to
its stream's output queue. Model work is serialised on that one thread: torch modules and CUDA graphs
are not shared across threads, and batching (not concurrency) is what buys throughput.

Batch choice: one model batch holds windows of a single shape key (see :meth:`Code2WavRunner.batch_key`),
so every window in it finishes together and its audio is routed as soon as that batch ends. The group
with the earliest *deadline* goes first (earliest deadline first), and a group runs its most urgent
windows. A window's deadline is when a listener needs it (:meth:`Code2WavEngine.deadline`): for a stream's
first window of an epoch, the moment it arrived (the listener is waiting for the first audio already);
for a later window, the moment the audio sent so far runs out if playback began with the first audio.
So first windows go before later windows that still have audio in hand, and among later windows the
stream closest to an underrun goes first, not the one whose window happened to arrive first: when many
sessions' windows arrive together (their units share one clock) and fall into several shape groups, the
order of the groups decides which streams wait a whole batch or two longer. The engine never idles
while a window is ready, so the order changes only who waits, not how much is done.

Interrupts and closes: :meth:`Code2WavEngine.interrupt` moves the stream to a new epoch, drops its queued
windows of older epochs (and discards the result of a window of an old epoch that is still running), and
resets the stream to the voice's origin cache, so the new epoch starts at chunk 0 exactly like a fresh
stream. A window already on the GPU cannot be recalled mid-kernel, but the stream no longer owes it: the
in-flight gauge drops at the interrupt or close, and ``minicpmo_stage_interrupt_drain_seconds`` records
how long that running batch still took (interrupt received -> last GPU step of the old epoch).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter, Gauge, Histogram

from services.code2wav.model.prompt import PromptFeatures, ReferenceAudioError, ReferenceVoiceEncoder
from services.code2wav.runner import Code2WavRunner, StreamState, WindowCursor, WindowResult
from services.common.errors import BAD_REFERENCE_AUDIO, INTERNAL, RESOURCE_EXHAUSTED, UNAVAILABLE, StageError
from services.common.memory_watch import MemoryWatch
from services.common.metrics import BATCH_SIZE, IN_FLIGHT, INTERRUPT_DRAIN, STEP_SECONDS
from services.common.slow_steps import StepTimer

log = logging.getLogger(__name__)
STAGE = "code2wav"

REAL_TIME_FACTOR = Histogram(
    "minicpmo_code2wav_real_time_factor",
    "Compute seconds per second of audio produced, per engine step (lower is faster)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
CACHE_BYTES = Gauge("minicpmo_code2wav_cache_bytes", "Flow + vocoder cache bytes held by open streams")
STREAMS_OPEN = Gauge("minicpmo_code2wav_streams", "Open Code2Wav streams")
AUDIO_SECONDS = Counter("minicpmo_code2wav_audio_seconds_total", "Seconds of audio produced")
FIRST_WINDOW_SECONDS = Histogram(
    "minicpmo_code2wav_first_window_seconds",
    "Time from a stream's first window arriving to its audio being ready",
    buckets=(0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
LATE_WINDOW_SECONDS = Histogram(
    "minicpmo_code2wav_late_window_seconds",
    "How far past its deadline (Code2WavEngine.deadline: when the audio sent before it runs out for a "
    "listener who began playing at the first audio) a later window arrived (phase=arrived) or had its "
    "audio routed (phase=done); observed only for windows that were late, so the count is the late "
    "windows. Late on arrival: the thinker or talker were late; late only when done: code2wav's queue",
    ["phase"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
DROPPED_WINDOWS = Counter("minicpmo_code2wav_dropped_windows_total", "Queued windows dropped by interrupts")
STORED_VOICE_LOADS = Counter(
    "minicpmo_code2wav_stored_voice_loads_total",
    "Registered voices' stored features decoded, checked and moved to the device (once per voice)",
)
STORED_VOICE_HITS = Counter(
    "minicpmo_code2wav_stored_voice_hits_total",
    "Streams opened with a registered voice whose features were already on the device",
)
STORED_VOICE_CACHE = 64  # registered voices whose device-resident features are kept (LRU; ~100 KB each)
HEAP_TRIMS = Counter(
    "minicpmo_code2wav_heap_trims_total", "Times the idle engine returned freed heap pages to the OS"
)
# Trim at most this often: steady traffic with short idle gaps should not pay a trim after every window.
TRIM_INTERVAL_S = 2.0


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: int(trim(0))


@dataclass
class PendingWindow:
    """A validated window waiting for (or in) a batch; ``tag`` is echoed back with the result."""

    epoch: int
    tokens: list[int]
    is_last: bool
    tag: Any
    enqueued: float = field(default_factory=time.perf_counter)
    # Set when an interrupt or close released this running window from the in-flight gauge (perf_counter
    # time of that release); the batch's end then records the drain time instead of decrementing again.
    released_at: float | None = None


@dataclass
class StreamHandle:
    """One open stream as the engine sees it."""

    stream_id: str
    prompt: PromptFeatures
    seed: int | None
    epoch: int
    state: StreamState
    cursor: WindowCursor = field(default_factory=WindowCursor)
    pending: deque[PendingWindow] = field(default_factory=deque)
    # (tag, WindowResult | StageError | None): None wakes the reader after an abandoned-epoch window.
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    in_flight: bool = False
    running: PendingWindow | None = None  # the window of this stream inside the batch being computed
    # Epoch the model state belongs to. A window of a newer epoch resets the state first. Comparing epochs
    # (not a flag set by interrupt) keeps a window that was already collected when an interrupt arrived
    # from consuming the reset meant for the new epoch.
    state_epoch: int = 0
    closed: bool = False
    first_window_latency: float | None = None
    # The current epoch's playout as a listener would hear it: when its first audio was routed
    # (perf_counter, None before) and the seconds of audio routed since.
    audio_start: float | None = None
    audio_sent_s: float = 0.0


class Code2WavEngine:
    """Owns the runner, the reference-voice encoder, the open streams and the scheduling loop."""

    def __init__(
        self,
        runner: Code2WavRunner,
        voices: ReferenceVoiceEncoder,
        default_voice: str | Path,
        max_batch: int = 16,
        max_streams: int = 64,
        window_codes: tuple[int, ...] = (25,),
    ) -> None:
        """``window_codes``: the steady window sizes (new codes) the warm-up captures graphs for."""
        self.runner = runner
        self.window_codes = window_codes
        self.voices = voices
        self.default_voice = Path(default_voice)
        self.max_batch = max_batch
        # A step runs up to max_batch windows (tens of ms by design): slow at 5x the stage threshold.
        self._timer = StepTimer(STAGE, scale=5.0)
        self._memory = MemoryWatch(STAGE, torch.device(runner.device))  # allocator gauges, high-water lines
        self.max_streams = max_streams
        self.streams: dict[int, StreamHandle] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="code2wav-model")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._default_prompt: PromptFeatures | None = None
        # Registered voices' features on the device, by the content key of their stored bytes.
        self._stored: OrderedDict[bytes, PromptFeatures] = OrderedDict()
        self.steps = 0
        self.batch_history: deque[int] = deque(maxlen=1024)  # rows per model batch, newest last
        self._trim = heap_trimmer()
        self._worked_since_trim = False
        self._last_trim = 0.0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Featurise the default voice, prime its origin cache and warm up the CUDA graphs, then start the
        scheduling loop (the server reports serving only after this returns)."""
        self._default_prompt = await self._in_worker(self.voices.encode_file, self.default_voice)
        await self._in_worker(self.runner.open_stream, "warmup", self._default_prompt, None)
        # Capture the graphs of every batch size _collect can form (1..max_batch), then freeze them: no
        # capture runs while serving (the runner logs the count and time; a no-op without graphs).
        if self.window_codes == (25,):
            await self._in_worker(self.runner.warm_up_shapes, self._default_prompt, self.max_batch)
        else:
            warm_up = functools.partial(self.runner.warm_up_shapes, steady_new=self.window_codes)
            await self._in_worker(warm_up, self._default_prompt, self.max_batch)
        self._task = asyncio.create_task(self._loop(), name="code2wav-scheduler")

    async def drain(self) -> None:
        """Stop accepting streams and wait until every queued window has been computed."""
        self._accepting = False
        while any(h.pending or h.in_flight for h in self.streams.values()):
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._accepting = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._worker.shutdown(wait=True, cancel_futures=True)

    async def _in_worker(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ------------------------------------------------------------------ streams
    async def open_stream(
        self,
        stream_id: str,
        reference: tuple[np.ndarray, int] | None,
        seed: int | None,
        epoch: int = 0,
        outputs: Any = None,
        prompt: PromptFeatures | None = None,
    ) -> StreamHandle:
        """Featurise the voice (LRU-cached) and create the stream from its origin cache.

        ``outputs`` (anything with ``put_nowait``) receives ``(tag, WindowResult | StageError | None)``
        per window; by default a fresh asyncio queue on the handle.
        """
        if not self._accepting:
            raise StageError(UNAVAILABLE, "code2wav is draining", "open")
        if len(self.streams) >= self.max_streams:
            raise StageError(
                RESOURCE_EXHAUSTED, f"code2wav already serves {self.max_streams} streams", "open"
            )
        if prompt is not None:  # a registered voice: its features were computed once, at registration
            pass
        elif reference is None:
            prompt = self._default_prompt
            assert prompt is not None, "engine not started"
        else:
            try:
                prompt = await self._in_worker(self.voices.encode, reference[0], reference[1])
            except ReferenceAudioError as exc:
                raise StageError(BAD_REFERENCE_AUDIO, str(exc), "open.ref_audio") from exc
        state = await self._in_worker(self.runner.open_stream, stream_id, prompt, seed)
        handle = StreamHandle(
            stream_id=stream_id, prompt=prompt, seed=seed, epoch=epoch, state=state, state_epoch=epoch
        )
        if outputs is not None:
            handle.outputs = outputs
        self.streams[id(handle)] = handle
        STREAMS_OPEN.set(len(self.streams))
        self._update_cache_gauge()
        return handle

    async def encode_voice(self, samples: np.ndarray, sample_rate: int) -> PromptFeatures:
        """The prompt features of a reference clip (voice registry); ``ReferenceAudioError`` if unusable."""
        return await self._in_worker(self.voices.encode, samples, sample_rate)

    def stored_voice(
        self, key: bytes, parts: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]]
    ) -> PromptFeatures:
        """A registered voice's features on the device: ``parts()`` (the stored tensors) checked and moved
        there once per ``key`` (the content key of the stored bytes), then reused by every stream.

        Why: the check and the host-to-device copies ran on the event loop for every stream, and a copy
        from pageable memory waits for the model thread's queued GPU work, so each registered-voice stream
        stalled every stream's windows behind the running batch; the default voice's features are made
        once at start. The origin cache (:meth:`Code2WavRunner.open_stream`) then keys the prompt setup
        by the features' digest, as for the default voice."""
        hit = self._stored.get(key)
        if hit is not None:
            self._stored.move_to_end(key)
            STORED_VOICE_HITS.inc()
            return hit
        prompt = self.prompt_from_parts(*parts())
        STORED_VOICE_LOADS.inc()
        self._stored[key] = prompt
        while len(self._stored) > STORED_VOICE_CACHE:
            self._stored.popitem(last=False)
        return prompt

    def prompt_from_parts(
        self, tokens: torch.Tensor, mel: torch.Tensor, spk_emb: torch.Tensor, digest: str
    ) -> PromptFeatures:
        """Stored features -> :class:`PromptFeatures` on the model device, checked against the default
        voice's shapes (every stream's prompt has the same shape, so they batch together)."""
        ref = self._default_prompt
        assert ref is not None, "engine not started"
        for name, got, want in (
            ("tokens", tokens, ref.tokens),
            ("mel", mel, ref.mel),
            ("spk_emb", spk_emb, ref.spk_emb),
        ):
            if tuple(got.shape) != tuple(want.shape):
                raise StageError(
                    BAD_REFERENCE_AUDIO,
                    f"voice {name} has shape {list(got.shape)}; this model needs {list(want.shape)}",
                    f"open.voice.{name}",
                )
        if not (torch.isfinite(mel).all() and torch.isfinite(spk_emb).all()):
            raise StageError(BAD_REFERENCE_AUDIO, "voice features are not finite", "open.voice")
        dev = ref.mel.device
        return PromptFeatures(
            tokens=tokens.to(dev, torch.int32),
            mel=mel.to(dev, ref.mel.dtype).contiguous(),
            spk_emb=spk_emb.to(dev, ref.spk_emb.dtype),
            digest=digest,
        )

    def submit(
        self, handle: StreamHandle, codes: list[int], left_context: int, is_last: bool, tag: Any
    ) -> None:
        """Validate (raises :class:`StageError`) and queue one window of the handle's current epoch."""
        tokens = self.runner.check_window(handle.cursor, codes, left_context, is_last)
        handle.pending.append(PendingWindow(handle.epoch, tokens, is_last, tag))
        IN_FLIGHT.labels(STAGE).inc()
        self._wake.set()

    def interrupt(self, handle: StreamHandle, new_epoch: int) -> int:
        """Move to ``new_epoch``: drop queued windows of older epochs; the stream restarts from its voice."""
        dropped = sum(1 for w in handle.pending if w.epoch < new_epoch)
        handle.pending = deque(w for w in handle.pending if w.epoch >= new_epoch)
        handle.epoch = new_epoch
        handle.cursor = WindowCursor()
        handle.audio_start, handle.audio_sent_s = None, 0.0  # the new epoch is a new first audio
        IN_FLIGHT.labels(STAGE).dec(dropped)
        DROPPED_WINDOWS.inc(dropped)
        self._release_running(handle, lambda w: w.epoch < new_epoch, record_idle=True)
        return dropped

    def close(self, handle: StreamHandle) -> None:
        handle.closed = True
        IN_FLIGHT.labels(STAGE).dec(len(handle.pending))
        handle.pending.clear()
        self._release_running(handle, lambda w: True, record_idle=False)
        self.streams.pop(id(handle), None)
        STREAMS_OPEN.set(len(self.streams))
        self._update_cache_gauge()

    @staticmethod
    def _release_running(handle: StreamHandle, stale: Any, record_idle: bool) -> None:
        """Take a running window the stream no longer wants off the in-flight gauge right away.

        Its batch still finishes on the GPU; :meth:`_record` then observes how long that took. With
        nothing running, an interrupt (``record_idle``) records a drain time of zero."""
        window = handle.running
        if window is None:
            if record_idle:
                INTERRUPT_DRAIN.labels(STAGE).observe(0.0)
            return
        if window.released_at is None and stale(window):
            window.released_at = time.perf_counter()
            IN_FLIGHT.labels(STAGE).dec()

    def _update_cache_gauge(self) -> None:
        CACHE_BYTES.set(sum(h.state.cache_bytes for h in self.streams.values()))

    # ------------------------------------------------------------------ scheduling
    @staticmethod
    def deadline(handle: StreamHandle) -> float:
        """When the listener needs the stream's next pending window (perf_counter seconds).

        A first window of its epoch (no audio routed yet: :meth:`interrupt` clears the playout clock) is
        due when it arrived: the listener has been waiting since. A later window is due when the audio
        routed so far runs out for a listener who started playing at the first audio (a client that
        starts later, or holds a lead, only has more slack)."""
        if handle.audio_start is None:
            return handle.pending[0].enqueued
        return handle.audio_start + handle.audio_sent_s

    def _collect(self) -> list[tuple[StreamHandle, PendingWindow]]:
        """The next batch: up to ``max_batch`` ready windows that share one shape key, earliest deadline
        first (:meth:`deadline`): the group holding the most urgent window, its most urgent windows.

        A window whose stream must first be reset to a new epoch gets a key of its own (its shapes are
        only known after the reset)."""
        ready = [h for h in self.streams.values() if h.pending and not h.in_flight and not h.closed]
        if not ready:
            return []
        groups: dict[tuple, list[StreamHandle]] = {}
        for handle in ready:
            window = handle.pending[0]
            if window.epoch > handle.state_epoch:
                key: tuple = ("reset", id(handle))
            else:
                key = self.runner.batch_key(handle.state, window.tokens, window.is_last)
            groups.setdefault(key, []).append(handle)

        due = {id(h): self.deadline(h) for h in ready}
        chosen = min(groups.values(), key=lambda members: min(due[id(h)] for h in members))
        chosen.sort(key=lambda h: due[id(h)])
        batch = []
        for handle in chosen[: self.max_batch]:
            window = handle.pending.popleft()
            batch.append((handle, window))
            handle.in_flight = True
            handle.running = window
        return batch

    def _compute(self, batch: list[tuple[StreamHandle, PendingWindow]]) -> list[WindowResult]:
        """Worker-thread body: reset streams entering a new epoch, then run every window of the batch."""
        for handle, window in batch:
            # A stale window (its epoch was interrupted after it was collected) runs on the old state,
            # whose result is discarded; the first window of the new epoch then starts from the voice.
            if window.epoch > handle.state_epoch:
                handle.state = self.runner.open_stream(handle.stream_id, handle.prompt, handle.seed)
                handle.state_epoch = window.epoch
        items = [(handle.state, window.tokens, window.is_last) for handle, window in batch]
        return self.runner.run(items)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                batch = self._collect()
                if not batch:
                    await self._idle_trim()
                    break
                self._worked_since_trim = True
                t0 = time.perf_counter()
                self._timer.start()
                firsts = sum(h.state.windows_done == 0 for h, _ in batch)
                try:
                    results = await self._in_worker(self._compute, batch)
                except Exception as exc:  # noqa: BLE001 - a failed batch must not kill the scheduler
                    log.exception("code2wav batch failed")
                    for handle, window in batch:
                        self._finish_running(handle, window, time.perf_counter())
                        handle.outputs.put_nowait(
                            (window.tag, StageError(INTERNAL, f"vocoder step failed: {exc}"))
                        )
                    continue
                elapsed = time.perf_counter() - t0
                self._timer.mark("windows", batch=len(batch), first_windows=firsts)
                self._record(batch, results, elapsed)
                self._timer.mark("route")
                self._timer.finish()
                self._memory.check()

    async def _idle_trim(self) -> None:
        """Hand the heap pages freed by finished batches back to the OS once the engine is idle.

        Why: on CPU a batch's working set (the stacked flow caches of every CFM step: hundreds of MiB at
        batch 4) is freed when it ends, but glibc keeps freed pages mapped, so after a burst of streams
        (dropped realtime sessions) the process stayed that much larger for good, which looked like a
        per-session leak. Trimming when idle returns them; at most every ``TRIM_INTERVAL_S`` (a wake is
        scheduled for a trim that is not due yet)."""
        if self._trim is None or not self._worked_since_trim:
            return
        wait = self._last_trim + TRIM_INTERVAL_S - time.monotonic()
        if wait > 0:
            asyncio.get_running_loop().call_later(wait, self._wake.set)
            return
        self._worked_since_trim = False
        self._last_trim = time.monotonic()
        await self._in_worker(self._trim)
        HEAP_TRIMS.inc()

    @staticmethod
    def _observe_lateness(deadline: float, arrived: float, done: float) -> None:
        """A later window past its deadline on arrival and/or when its audio was routed (the split tells
        an upstream stage's delay from this stage's queue)."""
        if arrived > deadline:
            LATE_WINDOW_SECONDS.labels("arrived").observe(arrived - deadline)
        if done > deadline:
            LATE_WINDOW_SECONDS.labels("done").observe(done - deadline)

    @staticmethod
    def _finish_running(handle: StreamHandle, window: PendingWindow, now: float) -> None:
        """The batch holding ``window`` ended: clear the stream's running slot and settle the gauge."""
        handle.in_flight = False
        handle.running = None
        if window.released_at is None:
            IN_FLIGHT.labels(STAGE).dec()
        else:
            INTERRUPT_DRAIN.labels(STAGE).observe(now - window.released_at)

    def _record(
        self, batch: list[tuple[StreamHandle, PendingWindow]], results: list[WindowResult], elapsed: float
    ) -> None:
        self.steps += 1
        sizes = list(self.runner.last_batch_sizes)
        self.runner.last_batch_sizes.clear()
        for size in sizes:
            BATCH_SIZE.labels(STAGE).observe(size)
            self.batch_history.append(size)
        STEP_SECONDS.labels(STAGE).observe(elapsed)
        audio = sum(r.samples.shape[0] for r in results) / self.runner.model.sample_rate
        if audio > 0:
            REAL_TIME_FACTOR.observe(elapsed / audio)
            AUDIO_SECONDS.inc(audio)
        now = time.perf_counter()
        for (handle, window), result in zip(batch, results, strict=True):
            self._finish_running(handle, window, now)
            if handle.closed:
                continue
            if window.epoch != handle.epoch:
                # Interrupted while running: the audio belongs to an abandoned epoch. Still wake the
                # stream's reader so a pending end-of-stream check sees the window is gone.
                handle.outputs.put_nowait((window.tag, None))
                continue
            if handle.first_window_latency is None:
                handle.first_window_latency = now - window.enqueued
                FIRST_WINDOW_SECONDS.observe(handle.first_window_latency)
            if result.samples.shape[0]:
                if handle.audio_start is None:
                    handle.audio_start = now
                else:
                    self._observe_lateness(handle.audio_start + handle.audio_sent_s, window.enqueued, now)
                handle.audio_sent_s += result.samples.shape[0] / self.runner.model.sample_rate
            handle.outputs.put_nowait((window.tag, result))
        self._update_cache_gauge()
        self._wake.set()
