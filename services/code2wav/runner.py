"""Synchronous Code2Wav executor: per-stream state, window validation and batched flow + HiFT steps.

The asyncio engine (:mod:`engine`) decides *when* windows run; this module decides *how*: windows whose
caches have the same shapes (same window index after the same 6 s prompt, same token count, same
``is_last``) are stacked into one batch through the flow and the vocoder, then the caches are split back
per stream. Nothing here mutates a cache tensor in place, so a stream's origin cache (the result of the
expensive prompt setup) is shared by every stream that starts from the same voice and seed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import Counter

from services.code2wav.model.flow_step import (
    FlowCache,
    FlowStepper,
    max_cache_bytes,
    split_caches,
    stack_caches,
)
from services.code2wav.model.loader import Token2WavModel
from services.code2wav.model.prompt import PromptFeatures
from services.code2wav.model.vocoder import HiftCache, VocoderStepper
from services.common.checkpoint import CODEC_SILENCE_ID
from services.common.errors import INVALID_ARGUMENT, OUT_OF_ORDER, StageError

if TYPE_CHECKING:
    from services.code2wav.model.cuda_graphs import ShapeKeyedGraphs

log = logging.getLogger(__name__)

ORIGIN_SETUPS = Counter(
    "minicpmo_code2wav_origin_setups_total",
    "Flow prompt setups (a voice and seed's origin cache, the expensive part of opening a stream); "
    "streams of a voice and seed already set up reuse it",
)
NOISE_TABLE_FRAMES = 50 * 600  # the reference noise buffer: [1, 80, 30000] drawn in one call
MAX_NEW_TOKENS = 50  # per window; bounds the noise table and the cache growth of one window
DEFAULT_SEED = 0


def cfm_noise_table(seed: int, mel_bins: int, frames: int) -> torch.Tensor:
    """CFM noise exactly as the reference draws it, [1, 80, 30000] from a seeded CPU generator, cut to
    the ``frames`` a stream can ever read (offsets never pass prompt + 100 frames after trimming)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn([1, mel_bins, NOISE_TABLE_FRAMES], generator=gen)[:, :, :frames].contiguous()


@dataclass
class StreamState:
    """Everything one stream (one request epoch) keeps between windows."""

    stream_id: str
    prompt: PromptFeatures
    spk_cond: torch.Tensor  # [1, 80] projected speaker condition
    noise: torch.Tensor  # [1, 80, N] CFM noise table
    flow: FlowCache
    hift: HiftCache
    nsf_generator: torch.Generator | None
    seed: int
    windows_done: int = 0
    samples_emitted: int = 0

    @property
    def cache_bytes(self) -> int:
        return self.flow.nbytes + self.hift.nbytes


@dataclass
class WindowCursor:
    """What a stream has *accepted* (validated and queued), which may run ahead of what it has computed."""

    windows: int = 0
    tail: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class WindowResult:
    """Output of one window: samples plus the mel that produced them (the mel is kept for dumps)."""

    samples: np.ndarray  # float32 [-1, 1], 24 kHz
    mel: torch.Tensor  # [80, F]
    is_last: bool


class Code2WavRunner:
    """Owns the model steppers, the origin-cache LRU and the rules every window must satisfy."""

    def __init__(
        self,
        model: Token2WavModel,
        n_timesteps: int = 10,
        cache_dtype: torch.dtype = torch.float32,
        nsf_noise: bool = False,
        origin_cache_size: int = 8,
        dit: str = "package",
        dit_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.device = model.device
        self.flow = FlowStepper(model, n_timesteps, dit=dit, dit_dtype=dit_dtype)
        # Estimator caches are kept in the DiT's compute dtype when that is narrower than cache_dtype
        # (a bf16 DiT produces bf16 caches; widening them would only cost memory and copies).
        narrow = dit_dtype.itemsize < cache_dtype.itemsize
        self.est_cache_dtype = dit_dtype if narrow else cache_dtype
        self.vocoder = VocoderStepper(model.hift)
        self.n_timesteps = n_timesteps
        self.cache_dtype = cache_dtype
        self.nsf_noise = nsf_noise
        self.lookahead = model.dims.lookahead
        self.up_rate = model.dims.up_rate
        self.vocab_size = model.dims.vocab_size
        self.min_new_tokens = -(-self.vocoder.holdback // (self.vocoder.hop * self.up_rate))
        self._origins: OrderedDict[tuple[str, int], tuple[FlowCache, torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )
        self._origin_cache_size = origin_cache_size
        self._origin_lock = threading.Lock()
        self.last_batch_sizes: list[int] = []
        # Set by :func:`services.code2wav.model.cuda_graphs.enable_cuda_graphs` (GPU only).
        self.cuda_graphs = False
        self.graph_sets: dict[str, ShapeKeyedGraphs] = {}
        # (batch_key, batch size) of every warm-up batch that replayed graphs only (see sub_batches).
        self.graphed_batches: set[tuple[tuple, int]] = set()

    # ---------------------------------------------------------------- streams
    def noise_frames(self, prompt_frames: int) -> int:
        return prompt_frames + 100 + (MAX_NEW_TOKENS + self.lookahead) * self.up_rate

    def max_stream_cache_bytes(self, prompt_frames: int) -> int:
        """Bound of one stream's cache bytes between windows (flow after trimming + vocoder tails)."""
        hift = (self.model.dims.mel_bins * 8 + 2 * self.vocoder.holdback) * 4
        flow = max_cache_bytes(
            self.model, prompt_frames, self.n_timesteps, self.cache_dtype, self.est_cache_dtype
        )
        return flow + hift

    def _origin(
        self, prompt: PromptFeatures, seed: int, noise: torch.Tensor | None
    ) -> tuple[FlowCache, torch.Tensor, torch.Tensor]:
        key = (prompt.digest, seed)
        injected = noise is not None
        if noise is None:
            with self._origin_lock:
                hit = self._origins.get(key)
                if hit is not None:
                    self._origins.move_to_end(key)
                    return hit
            noise = cfm_noise_table(seed, self.model.dims.mel_bins, self.noise_frames(prompt.frames))
        noise = noise.to(self.device, torch.float32)
        ORIGIN_SETUPS.inc()
        spk_cond = self.flow.project_speaker(prompt.spk_emb)
        silence = torch.full(
            (1, self.lookahead), CODEC_SILENCE_ID, dtype=prompt.tokens.dtype, device=self.device
        )
        cache = self.flow.setup(torch.cat([prompt.tokens, silence], dim=1), prompt.mel, spk_cond, noise)
        entry = (cache.to(self.cache_dtype, self.est_cache_dtype), spk_cond, noise)
        if injected:  # an injected noise table is not what ``seed`` means: never share it
            return entry
        with self._origin_lock:
            self._origins[key] = entry
            while len(self._origins) > self._origin_cache_size:
                self._origins.popitem(last=False)
        return entry

    def open_stream(
        self,
        stream_id: str,
        prompt: PromptFeatures,
        seed: int | None = None,
        noise: torch.Tensor | None = None,
    ) -> StreamState:
        """Start a stream from a voice: prompt setup (cached per voice and seed) and fresh vocoder state.

        ``noise`` overrides the seeded CFM noise table (fidelity dumps inject the oracle's table).
        """
        seed = DEFAULT_SEED if seed is None else int(seed)
        flow_cache, spk_cond, noise_table = self._origin(prompt, seed, noise)
        generator = None
        if self.nsf_noise:
            generator = torch.Generator(device=self.device).manual_seed(seed ^ 0x5EED)
        return StreamState(
            stream_id=stream_id,
            prompt=prompt,
            spk_cond=spk_cond,
            noise=noise_table,
            flow=flow_cache,
            hift=HiftCache.empty(self.model.dims.mel_bins, self.device),
            nsf_generator=generator,
            seed=seed,
        )

    def warm_up_shapes(
        self,
        prompt: PromptFeatures,
        max_batch: int = 1,
        first_windows: tuple[int, ...] = (10, 25),
        steady_windows: int = 3,
        steady_new: int | tuple[int, ...] = 25,
        last_windows: tuple[int, ...] | None = None,
    ) -> int:
        """Capture the CUDA graphs of every batch the engine can form, then freeze them (graphs only).

        For each batch size ``b`` in ``max_batch``..1, ``b`` throwaway streams run together through the
        same batched path as live traffic: a first window of each size in ``first_windows``, then
        ``steady_windows`` windows of ``steady_new`` codes (enough for the estimator caches to reach their
        trimmed steady length). After a first window shorter than ``steady_new``, one more window of the
        remaining ``steady_new - first`` codes runs from the first window's state on a copy: a realtime
        speaking unit (25 frames) with a 10-frame first window flushes its other 15 frames as that
        window, and without its graph it would run eager (slow, and it lengthens a barge-in's drain).
        Each new shape captures its graphs on first use; doing all of it before the server reports
        serving keeps capture (hundreds of ms, and a cuDNN failure under GPU time-slicing on the H200)
        away from live traffic, which after the freeze never captures: shapes not covered here run eager.
        Largest batches go first so the shared graph arenas and memory pool reach their final size at
        once.

        ``last_windows`` lists the new-code counts of last windows to capture from the steady (trimmed)
        caches, which is where a reply longer than the warm-up's windows ends (default: 0..24, the
        talker's remainders, with the fused flow; none with the package path, whose last windows run
        eager). The empty one (0, the end of a duplex turn) is captured at every batch size; the others
        at the power-of-two batch sizes 1, 2, 4, ... up to ``max_batch``, which :meth:`sub_batches` splits
        any batch of them into (several replies ending together would otherwise run one eager batch).
        Every size would add ``max_batch - 1`` windows per non-zero remainder; powers of two add
        ``floor(log2(max_batch))``: with the defaults at ``max_batch`` 16 that is 96 more windows than
        batch 1 alone (184 -> 280), where every size would be 360 more. At batch 1 the same last windows
        are also captured from every state before the caches are steady (after a first window, its flush,
        a steady window short of the trim: 320, 350 and 370 estimator frames with the defaults), where a
        short reply ends (a one-unit realtime answer ends with the empty window at 350; a chat reply of
        50-59 frames with 15-24 codes at 370): 75 more windows at batch 1, and a batch of them replays one
        window at a time (:meth:`sub_batches`). Returns the number of windows run; the (key, batch size)
        pairs that replayed without an eager call go to ``graphed_batches``.

        ``steady_new`` may name several window sizes (the stage's ``--window-codes``: the talker's
        ``codec.window_frames`` of the deployment, 25 by default, and e.g. 50 when turn-mode speech uses
        2 s windows while realtime units stay at 25): each gets the whole pass above, with a first window
        of its own size added to ``first_windows`` and, by default, its own remainders as last windows."""
        sizes = (steady_new,) if isinstance(steady_new, int) else tuple(dict.fromkeys(steady_new))
        if not self.cuda_graphs:
            return 0
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        for graphs in self.graph_sets.values():
            graphs.frozen = False
        self.graphed_batches.clear()
        ran = 0
        try:
            for batch in range(max(1, max_batch), 0, -1):
                for size in sizes:
                    firsts = tuple(sorted(set(first_windows) | ({size} if len(sizes) > 1 else set())))
                    lasts = last_windows
                    if lasts is None:
                        lasts = tuple(range(size)) if self.flow.fused is not None else ()
                    for first in firsts:
                        # The last windows come once per batch size and window size, from the longest
                        # first window's states; a short reply's, before the caches are steady, at batch
                        # 1 only (a batch of them runs as ones, :meth:`sub_batches`).
                        last = lasts if first == max(firsts) else ()
                        early = lasts if batch == 1 else ()
                        ran += self._warm_up_streams(prompt, batch, first, steady_windows, size, last, early)
        finally:
            # Frozen even if the warm-up failed part-way: capturing under live traffic is the failure
            # this avoids, so a shape the warm-up did not reach runs eager rather than capturing later.
            self.last_batch_sizes.clear()
            for graphs in self.graph_sets.values():
                graphs.frozen = True
        self._log_warm_up(ran, max(1, max_batch), time.perf_counter() - t0, reserved)
        return ran

    def _warm_up_streams(
        self,
        prompt: PromptFeatures,
        batch: int,
        first: int,
        steady_windows: int,
        steady_new: int,
        last_windows: tuple[int, ...],
        early_last_windows: tuple[int, ...] = (),
    ) -> int:
        """One warm-up pass of ``batch`` throwaway streams (:meth:`warm_up_shapes`); returns its window count.

        ``early_last_windows``: last windows to capture also from the states before the caches reach their
        steady length (after the first window, its flush, and each steady window short of the trim), each
        state whose shapes no earlier pass captured them for."""
        states = [self.open_stream(f"warm-up-{batch}-{first}-{i}", prompt) for i in range(batch)]
        window = [CODEC_SILENCE_ID] * (self.lookahead + first)
        ran = self._warm_up_batch(states, window, False)
        early = [[replace(s) for s in states]]  # the states a reply of one window ends from
        if first < steady_new:  # a realtime unit's flush right after a short first window
            realign = [CODEC_SILENCE_ID] * (self.lookahead + steady_new - first)
            flushed = [replace(s) for s in states]
            ran += self._warm_up_batch(flushed, realign, False)
            early.append(flushed)
        for _ in range(steady_windows):
            window = [CODEC_SILENCE_ID] * (self.lookahead + steady_new)
            ran += self._warm_up_batch(states, window, False)
            early.append([replace(s) for s in states])
        # Last windows, each on copies of the same steady states (caches are immutable). The empty one
        # ends each duplex turn (a unit is a whole window), so it comes from several sessions at once at
        # any batch size; a remainder only at the power-of-two sizes :meth:`sub_batches` splits into.
        power_of_two = batch & (batch - 1) == 0
        for new in last_windows if power_of_two else [n for n in last_windows if n == 0]:
            last = [replace(s) for s in states]
            ran += self._warm_up_batch(last, [CODEC_SILENCE_ID] * (self.lookahead + new), True)
        steady = states[0].flow.signature()
        for group in early:
            if group[0].flow.signature() == steady:
                continue  # the steady state: its last windows are the ones above
            for new in early_last_windows:
                window = [CODEC_SILENCE_ID] * (self.lookahead + new)
                if (self.batch_key(group[0], window, True), len(group)) in self.graphed_batches:
                    continue  # reached by an earlier pass too (a 25-code first window = 10 + its flush)
                ran += self._warm_up_batch([replace(s) for s in group], window, True)
        return ran

    def _warm_up_batch(self, states: list[StreamState], window: list[int], is_last: bool) -> int:
        """Run one warm-up batch (every stream the same window) and note whether it left any part eager:
        only a batch whose graphs all captured may be a target of :meth:`sub_batches`. Returns 1."""
        eager = sum(g.eager_calls for g in self.graph_sets.values())
        key = self.batch_key(states[0], window, is_last)
        self.run_batch(states, [window] * len(states), is_last)
        if sum(g.eager_calls for g in self.graph_sets.values()) == eager:
            self.graphed_batches.add((key, len(states)))
        return 1

    def _log_warm_up(self, ran: int, max_batch: int, seconds: float, reserved: int) -> None:
        memory = ""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            grown = torch.cuda.memory_reserved(self.device) - reserved
            memory = f", reserved memory {grown / 2**30:+.2f} GiB (graphs, outputs, cached activations)"
        parts = []
        for name, graphs in self.graph_sets.items():
            missed = len(graphs.graphs) - graphs.captured  # failed captures, keys over max_graphs
            parts.append(f"{name} {graphs.captured}" + (f" ({missed} left eager)" if missed else ""))
        log.info(
            "code2wav warm-up: captured %d CUDA graphs [%s] over %d windows of batch sizes 1..%d in %.1f s%s;"
            " graph sets frozen",
            sum(g.captured for g in self.graph_sets.values()),
            ", ".join(parts),
            ran,
            max_batch,
            seconds,
            memory,
        )

    # ---------------------------------------------------------------- validation
    def check_window(
        self, cursor: WindowCursor, codes: list[int], left_context: int, is_last: bool
    ) -> list[int]:
        """Validate a codec window against what the stream has accepted so far; return the flow tokens.

        Rules: ids in the flow vocabulary; ``left_context`` equals the lookahead (3), or is 0 on the first
        window (then silence is prepended, as the reference does); the context repeats the previous
        window's last tokens; a non-final window brings at least enough new tokens to fill the 160 ms
        hold-back; nothing after the last window. On success the cursor advances.
        """
        if cursor.finished:
            raise StageError(OUT_OF_ORDER, "window after the stream's last window", "window")
        bad = [c for c in codes if not 0 <= c < self.vocab_size]
        if bad:
            raise StageError(
                INVALID_ARGUMENT, f"codec ids out of range [0, {self.vocab_size}): {bad[:5]}", "window.codes"
            )
        if left_context > len(codes):
            raise StageError(
                INVALID_ARGUMENT, "left_context exceeds the number of codes", "window.left_context"
            )
        if cursor.windows == 0 and left_context == 0:
            codes = [CODEC_SILENCE_ID] * self.lookahead + list(codes)
            left_context = self.lookahead
        if left_context != self.lookahead:
            raise StageError(
                INVALID_ARGUMENT,
                f"left_context must be {self.lookahead} (got {left_context})",
                "window.left_context",
            )
        if cursor.windows > 0 and list(codes[: self.lookahead]) != cursor.tail:
            raise StageError(
                INVALID_ARGUMENT,
                "left context does not repeat the previous window's last codes",
                "window.codes",
            )
        new = len(codes) - left_context
        if new > MAX_NEW_TOKENS:
            raise StageError(
                INVALID_ARGUMENT, f"window has {new} new codes; at most {MAX_NEW_TOKENS}", "window.codes"
            )
        if not is_last and new < self.min_new_tokens:
            raise StageError(
                INVALID_ARGUMENT,
                f"non-final window too short: {new} new codes, at least {self.min_new_tokens}",
                "window.codes",
            )
        cursor.windows += 1
        cursor.tail = list(codes[-self.lookahead :])
        cursor.finished = is_last
        return list(codes)

    # ---------------------------------------------------------------- execution
    @staticmethod
    def batch_key(state: StreamState, tokens: list[int], is_last: bool) -> tuple:
        """Windows with equal keys have equal tensor shapes everywhere and may share one batch."""
        return (
            state.flow.signature(),
            state.hift.signature(),
            state.prompt.frames,
            state.noise.shape[2],
            len(tokens),
            bool(is_last),
            state.nsf_generator is not None,
        )

    @torch.inference_mode()
    def run_batch(
        self, states: list[StreamState], windows: list[list[int]], is_last: bool
    ) -> list[WindowResult]:
        """Run one batch of same-key windows; updates every state in place and returns their outputs."""
        tokens = torch.tensor(windows, dtype=torch.int32, device=self.device)
        flow_cache = stack_caches([s.flow for s in states], torch.float32, self.flow.compute_dtype)
        spk = torch.cat([s.spk_cond for s in states], dim=0)
        noise = torch.cat([s.noise for s in states], dim=0)
        mel, flow_cache = self.flow.step(tokens, spk, flow_cache, noise, is_last, states[0].prompt.frames)
        # With CUDA graphs, mel and the caches may be views of the shared output arena, which the vocoder's
        # replays overwrite: split the caches (the per-stream copies the states keep anyway) and copy
        # the mel before the vocoder runs.
        mel = mel.clone()
        flow_caches = split_caches(flow_cache, self.cache_dtype, self.est_cache_dtype)
        del flow_cache
        generators = None
        if states[0].nsf_generator is not None:  # every state of a batch has one or none (batch key)
            generators = [s.nsf_generator for s in states if s.nsf_generator is not None]
        speech, hift_caches = self.vocoder.step(mel, [s.hift for s in states], is_last, generators)
        speech_np = speech.float().cpu().numpy()  # one device->host copy (and sync) per batch
        mel_cpu = mel.float().cpu()
        results = []
        for i, (state, flow_i) in enumerate(zip(states, flow_caches, strict=True)):
            state.flow = flow_i
            state.hift = hift_caches[i]
            state.windows_done += 1
            state.samples_emitted += speech_np.shape[1]
            results.append(WindowResult(samples=speech_np[i].copy(), mel=mel_cpu[i], is_last=is_last))
        self.last_batch_sizes.append(len(states))
        return results

    def run(self, items: list[tuple[StreamState, list[int], bool]]) -> list[WindowResult]:
        """Group windows by :meth:`batch_key`, run each group as one batch (or as the graphed sub-batches
        :meth:`sub_batches` picks), return results in input order."""
        groups: OrderedDict[tuple, list[int]] = OrderedDict()
        seen: set[int] = set()
        for idx, (state, tokens, last) in enumerate(items):
            if id(state) in seen:
                raise ValueError("a batch may hold at most one window per stream")
            seen.add(id(state))
            groups.setdefault(self.batch_key(state, tokens, last), []).append(idx)
        out: list[WindowResult | None] = [None] * len(items)
        for key, idxs in groups.items():
            start = 0
            for size in self.sub_batches(key, len(idxs)):
                part = idxs[start : start + size]
                start += size
                res = self.run_batch([items[i][0] for i in part], [items[i][1] for i in part], bool(key[5]))
                for i, r in zip(part, res, strict=True):
                    out[i] = r
        return [r for r in out if r is not None]

    def sub_batches(self, key: tuple, size: int) -> list[int]:
        """Batch sizes to run ``size`` windows of one :meth:`batch_key` as: ``[size]``, or, when the frozen
        graph sets replay the key at other batch sizes but not at ``size``, those sizes, largest first.

        The warm-up captures last windows with a remainder only at power-of-two batch sizes (every size
        would cost ~90 s of start-up), so a batch of, say, 7 replies ending together would run eager, which
        is slow on the GPU and lengthens every one of those replies' tails; 4 + 2 + 1 replays instead. The
        last windows of short replies (caches not yet steady) are captured at batch 1 only, so several of
        them replay one at a time. Only pairs the warm-up ran graph-only count (``graphed_batches``): a
        batch that has its own graph (steady windows, empty last windows), any batch without graphs (CPU)
        and a batch whose key has no graph at all are never split. Unfrozen sets capture any new size, so
        no split either."""
        if (key, size) in self.graphed_batches or not self.graph_sets:
            return [size]
        if not all(g.frozen for g in self.graph_sets.values()):
            return [size]
        sizes = sorted((n for k, n in self.graphed_batches if k == key and n < size), reverse=True)
        parts: list[int] = []
        left = size
        for n in sizes:
            while left >= n:
                parts.append(n)
                left -= n
        return parts if left == 0 else [size]
