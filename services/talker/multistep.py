"""Several decode+sample steps per graph replay: the talker's per-frame host work off the critical path.

Why: one decode step replays in ~0.86 ms on the H200 at batch 1, but the engine step took ~1.2–1.5 ms
(BENCHMARKS.md, Talker): packing rows, two host tensors, pinned copies, the sync and per-stream Python
ran once per frame with the GPU idle. Here one captured graph runs ``k`` consecutive steps, each
step's picked id becoming the next step's input code and the 16-frame penalty history updated on the
device, so the fixed host cost (tensors, copies, launch, sync) is paid once per ``k`` frames.

Why it generates exactly what one step per replay generates:

* Every input a step needs is known before the block starts, for as long as the row's segment goes on:
  its position (start + j), its draw key (the seed and draw counter + j: :func:`sampling.row_key`), its
  sampler rules (a pure function of the step index in the segment and the frames of the turn, both
  + j while the segment continues: ``TalkerEngine._rules(st, ahead=j)``), its input code (the id just
  picked, on the device) and its penalty history (the last 16 kept frames: every id picked while the
  segment goes on is kept, so the device appends each id to a 16-column ring; the penalty counts ids,
  so column order is irrelevant and a penalty of 1.0 leaves scores bit-identical whatever it holds).
* The host then runs the engine's own ``_on_sample`` on each row's ids in order and drops the ids after
  the row's segment ended (EOS, budget, frame count, context). Cache lengths advance only by the steps
  actually taken (``length = start + j + 1`` before id j is judged, as the one-step path has it), as do
  the draw counters. The steps the graph ran past a row's end wrote K/V at positions beyond the row's
  length: both attention paths read only positions ≤ the row's own position (the torch mask
  ``cols <= pos``, the paged kernel's ``[0, pos]``), so they are never seen, and the next prefill or
  step of the slot overwrites them. A row never writes past ``context - 1`` (its step count is capped
  by the room left) and writes only its own slot (row = slot, idle steps go to the scratch row).
* The attention length bucket of a block is the one the one-step path uses at the block's first step;
  the block stops before the highest position would cross into the next bucket, so no step sees a
  different ``read_len`` (which sizes the fused kernel's key split) than it would one step at a time.
  (When a row ends inside a block the others keep that block's bucket, where one step at a time might
  drop to a smaller one; on CPU fp32 masked columns add exact zeros, on the GPU it is a bf16 near-tie
  at most, as between any two buckets.)
* Block lengths are the powers of two up to ``k`` (and ``k``): a block runs the smallest one covering
  its longest row, so a duplex unit's 25 frames with ``k = 8`` cost 8+8+8+1 steps, not 32.

Commands (interrupts, new streams, prefills) apply between blocks, so an interrupt waits for at most one
block of ``k`` steps. Logit observers (dumps, tests) get each step's logits as with one step per replay.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from services.talker import sampling as smp
from services.talker.runner import MIN_LENGTH_BUCKET, TalkerRunner, _DecodeGraph, next_bucket
from services.talker.streams import Phase, StreamState, TurnForm


class BlockHost(Protocol):
    """What a block uses of its engine (:class:`services.talker.engine.TalkerEngine`, which imports this
    module: a protocol, so this module need not import the engine back)."""

    runner: TalkerRunner
    logits_observer: Callable[[StreamState, torch.Tensor], None] | None
    streaming_chunk_cap: int

    def _rules(self, st: StreamState, ahead: int = 0) -> smp.StepRules: ...

    def _guarded(self, st: StreamState, fn: Callable[[StreamState], None]) -> None: ...

    def _on_sample(self, st: StreamState, code: int) -> None: ...


log = logging.getLogger(__name__)

# Steps per replay with CUDA graphs on: 4 keeps an interrupt's wait at ~4 decode steps (~4 ms) while the
# fixed host cost per frame drops 4×; ``bench.talker --steps-per-replay 1,4,8`` measures the choice.
DEFAULT_STEPS_ON_CUDA = 4

# Host int64 columns of one block row: the first input code, the history ring, then per step j the
# columns ``position, active, key, top-k, flags, ring column to write``.
_CODE = 0
_HIST = 1
_STEPS = _HIST + smp.PENALTY_WINDOW
STEP_INTS = 6
STEP_FLOATS = smp.FLOAT_COLUMNS
ACTIVE_COLUMNS = slice(_STEPS + 1, None, STEP_INTS)  # every step's ``active`` column (benchmarks idle them)


def select_steps(requested: int | None, graphs: bool) -> int:
    """Steps per replay: ``requested`` (the profile's ``steps_per_replay``, ``--steps-per-replay``), else 4
    with graphs, 1 without.

    Without CUDA graphs (CPU, tests, fidelity dumps) nothing is saved by blocks, so the default stays 1.
    """
    if requested is None:
        requested = DEFAULT_STEPS_ON_CUDA if graphs else 1
    if requested < 1:
        raise ValueError(f"steps per replay must be ≥ 1 (got {requested})")
    return int(requested)


def block_lengths(steps: int) -> list[int]:
    """The block lengths a decoder with ``steps`` per replay captures: powers of two below it, and it."""
    out = []
    k = 1
    while k < steps:
        out.append(k)
        k *= 2
    return [*out, steps]


def block_eager(
    runner: TalkerRunner, ints: torch.Tensor, floats: torch.Tensor, read_len: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` decode+sample steps over slots ``0..n-1``; returns (fp32 logits [n, k, V], ids [n, k]).

    Each step is :meth:`TalkerRunner._step_eager` itself (the same forward and sampler as one step per
    replay) on int rows assembled from the block's columns, the previous step's ids as codes and the
    device-side history ring. Fixed shapes only: this is what the block graph captures and what CPU runs.
    """
    code = ints[:, _CODE]
    hist = ints[:, _HIST:_STEPS]
    all_logits, all_ids = [], []
    for j in range(k):
        c = _STEPS + STEP_INTS * j
        step = torch.cat([code[:, None], ints[:, c : c + 5], hist], dim=1)
        logits, ids = runner._step_eager(step, floats[:, STEP_FLOATS * j : STEP_FLOATS * (j + 1)], read_len)
        all_logits.append(logits)
        all_ids.append(ids)
        if j + 1 < k:
            hist = hist.scatter(1, ints[:, c + 5 : c + 6], ids[:, None])
            code = ids
    return torch.stack(all_logits, dim=1), torch.stack(all_ids, dim=1)


class BlockDecoder:
    """The runner's K-steps-per-replay decode: step planning, host packing, graphs per (batch, length, k)."""

    def __init__(self, runner: TalkerRunner, steps: int) -> None:
        self.runner = runner
        self.steps = steps
        self.lengths = block_lengths(steps)
        self._graphs: dict[tuple[int, int, int], _DecodeGraph] = {}
        self.vocab = runner.cfg.num_audio_tokens
        idle_ints, idle_floats = smp.idle_row(self.vocab)
        self._idle_knobs = idle_ints[:3]
        self._idle_step = [0, 0, *self._idle_knobs, 0]  # inactive: K/V to scratch, greedy, nothing applied
        self._idle_hist = idle_ints[3:]
        self._idle_floats = idle_floats

    def clear(self) -> None:
        self._graphs.clear()

    # ------------------------------------------------------------------------------------ planning
    def plan(self, slots: Sequence[int], wanted: Sequence[int]) -> tuple[list[int], int]:
        """(steps per row, attention length) for a block where row i would like ``wanted[i]`` steps.

        Each row gets at most the room left in its context, and every row stops before the highest
        position crosses into the next attention length bucket (see the module docstring); ≥ 1 each.
        """
        context = self.runner.context
        lengths = self.runner.cache.lengths
        starts = [lengths[s] for s in slots]
        for s, pos in zip(slots, starts, strict=True):
            if pos >= context:
                raise ValueError(f"slot {s} is at the Talker context limit {context}")
        top = max(starts)
        read_len = min(next_bucket(top + 1, MIN_LENGTH_BUCKET), context)
        cap = min(self.steps, read_len - top)
        steps = [max(1, min(w, cap, context - p)) for w, p in zip(wanted, starts, strict=True)]
        return steps, read_len

    def _length_for(self, steps: int) -> int:
        return next(k for k in self.lengths if k >= steps)

    # ------------------------------------------------------------------------------------- running
    def decode(
        self,
        slots: Sequence[int],
        codes: Sequence[int],
        histories: Sequence[Sequence[int]],
        knobs: Sequence[Sequence[tuple[list[int], list[float]]]],
        read_len: int,
        want_logits: bool = False,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Run one block; row i feeds ``codes[i]`` then its own picks for ``len(knobs[i])`` steps.

        ``knobs[i][j]`` is row i's (key, top-k, flags), (temperature, penalty, top-p) at step j
        (:func:`sampling.step_knobs`), ``histories[i]`` its kept frames so far (the last 16 count).
        Returns each row's picked ids (``len(knobs[i])`` of them) and, if asked, the fp32 logits
        ``[len(slots), k, V]``. Advances nothing: the caller sets cache lengths and draw counters by
        the steps it keeps.
        """
        runner = self.runner
        cache = runner.cache
        n = min(next_bucket(max(slots) + 1), cache.num_slots)
        k = self._length_for(max(len(row) for row in knobs))
        window = smp.PENALTY_WINDOW
        idle_int_row = [0, *self._idle_hist, *(self._idle_step * k)]
        idle_float_row = self._idle_floats * k
        int_rows: list[list[int]] = [idle_int_row] * n
        float_rows: list[list[float]] = [idle_float_row] * n
        lengths = cache.lengths
        for slot, code, hist, row_knobs in zip(slots, codes, histories, knobs, strict=True):
            recent = list(hist[-window:])
            ring = len(recent) % window
            ints = [int(code), *recent, *([self.vocab] * (window - len(recent)))]
            floats: list[float] = []
            pos = lengths[slot]
            for j, (k_ints, k_floats) in enumerate(row_knobs):
                ints += [pos + j, 1, *k_ints, (ring + j) % window]
                floats += k_floats
            for _ in range(len(row_knobs), k):
                ints += self._idle_step
                floats += self._idle_floats
            int_rows[slot] = ints
            float_rows[slot] = floats
        with torch.inference_mode():
            host_ints = torch.tensor(int_rows, dtype=torch.int64)
            host_floats = torch.tensor(float_rows, dtype=torch.float32)
            graph = self._graph(n, read_len, k) if runner.use_cuda_graphs else None
            if graph is not None:
                logits, ids = graph.run(host_ints, host_floats)
            else:
                dev = runner.device
                logits, ids = block_eager(runner, host_ints.to(dev), host_floats.to(dev), read_len, k)
            picked = ids.tolist()
            out_logits = None
            if want_logits:
                out_logits = logits.index_select(0, torch.tensor(list(slots), device=runner.device))
        return [picked[s][: len(row)] for s, row in zip(slots, knobs, strict=True)], out_logits

    def _graph(self, n: int, read_len: int, k: int) -> _DecodeGraph | None:
        """The captured ``k``-step block for this bucket; None (and graphs off) if capture failed."""
        key = (n, read_len, k)
        graph = self._graphs.get(key)
        if graph is None:
            runner = self.runner
            log.info(
                "capturing talker %d-step decode CUDA graph: batch %d, attention length %d", k, n, read_len
            )
            try:
                dev = runner.device
                ints = torch.tensor(
                    [0, *self._idle_hist, *(self._idle_step * k)], dtype=torch.int64, device=dev
                ).repeat(n, 1)
                floats = torch.tensor(self._idle_floats * k, dtype=torch.float32, device=dev).repeat(n, 1)

                def step(i: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                    return block_eager(runner, i, f, read_len, k)

                graph = _DecodeGraph(step, ints, floats, runner._graph_pool)
            except Exception:
                log.exception("talker block decode CUDA graph capture failed; decoding eagerly from now on")
                runner.disable_graphs()
                return None
            self._graphs[key] = graph
        return graph

    def warmup(self, batches: Sequence[int], lengths: Sequence[int]) -> int:
        """Capture every (batch, length, block length) graph ahead of traffic; returns how many exist."""
        if not self.runner.use_cuda_graphs:
            return 0
        with torch.inference_mode():
            for n in batches:
                for read_len in lengths:
                    for k in self.lengths:
                        if self._graph(n, read_len, k) is None:
                            return 0
        return len(self._graphs)


# ---------------------------------------------------------------------------------- engine side
def forced_end(engine: BlockHost, st: StreamState) -> int:
    """Samples left before ``st``'s segment must end whatever it samples (budget, frame count, cap).

    Only sizes the block (steps past this would be dropped anyway); an EOS may end the segment sooner.
    """
    s = st.settings
    if st.form is TurnForm.DUPLEX:
        assert st.seg_budget is not None
        left = st.seg_budget.max_samples - st.seg_t  # the sample at t = max_samples - 1 ends the unit
    elif st.form is TurnForm.WHOLE:
        left = (s.fixed_frames or s.max_new_frames) - st.turn_frames
    else:
        left = min(s.max_new_frames - st.turn_frames, engine.streaming_chunk_cap - st.seg_t)
    return max(1, left)


def decode_block(engine: BlockHost, batch: list[StreamState]) -> None:
    """One block for ``batch``: plan, pack every step's knobs, replay once, then judge the ids in order.

    Each row's ids go through ``engine._on_sample`` one by one, exactly as if each came from its own
    step: before id j the slot's cache length is ``start + j + 1`` and the row's draw counter has
    advanced once per earlier id; the first id that ends the segment (or an error) stops the row, and
    its later ids are dropped.
    """
    runner = engine.runner
    blocks = runner.blocks
    assert isinstance(blocks, BlockDecoder)
    slots = [st.slot for st in batch]
    assert all(s is not None for s in slots)
    slot_ids: list[int] = slots  # type: ignore[assignment]
    wanted = [min(blocks.steps, forced_end(engine, st)) for st in batch]
    steps, read_len = blocks.plan(slot_ids, wanted)
    codes: list[int] = []
    knobs: list[list[tuple[list[int], list[float]]]] = []
    histories: list[list[int]] = []
    for st, count in zip(batch, steps, strict=True):
        row = st.row
        assert row is not None and st.pending_code is not None
        codes.append(st.pending_code)
        st.pending_code = None
        histories.append(row.history)
        knobs.append([smp.step_knobs(row.params, engine._rules(st, j), row.draws + j) for j in range(count)])
    observer = engine.logits_observer
    starts = [runner.cache.lengths[s] for s in slot_ids]
    ids, logits = blocks.decode(slot_ids, codes, histories, knobs, read_len, want_logits=observer is not None)
    lengths = runner.cache.lengths
    for i, st in enumerate(batch):
        row = st.row
        assert row is not None
        greedy = row.params.greedy
        for j, code in enumerate(ids[i]):
            if j and st.phase is not Phase.DECODE:
                break  # the segment ended at the previous id: the graph's later steps are dropped
            st.pending_code = None
            lengths[slot_ids[i]] = starts[i] + j + 1
            if not greedy:
                row.draws += 1
            if observer is not None:
                assert logits is not None
                observer(st, logits[i, j])
            engine._guarded(st, functools.partial(engine._on_sample, code=code))
