"""Overlapped decode: launch step n+1 on the device before the host reads step n's tokens.

Why: a synchronous engine step launches the graph replay, waits for its tokens, then spends host time
(events, stop checks, metrics, building the next step's rows) with the device idle; bench.thinker
measured that gap at 0.17 ms (batch 1) to 0.42 ms (batch 16) per step on an H200. When the next step
is known without the tokens — the same decode rows, each one position further — the next replay can take
its input ids from the previous step's token buffer on the device (:meth:`RowGraph.run` ``ids_from``),
and the host work of step n runs while the device computes step n+1.

Which tokens land in that buffer: the graph's own argmax of every row, which is a plain greedy row's
choice; rows that need more get it from operations queued right behind the replay by
:func:`settle` (:func:`services.thinker.sampling.choose_on_device`), which overwrite their entries:

* a grammar row (tools, ``response_format``): its packed bitmask is filled on the host by llguidance
  while the device runs the step, copied from pinned memory, applied to the row's logits, and the
  masked argmax (or the masked draw) is written in place;
* a temperature/top-k/top-p row: the same draw as the host path's, on the device, from the row's own
  generator (seeded rows reproduce), in row order.

So the host is one step behind: an engine call launches step n+1 chained, reads step n's tokens (already
on their way), hands each to its sampler (which advances its grammar), fills the masks of step n+1 and
queues their upload, the choice and the tokens' copy behind step n+1's replay. The device never waits for
the host while the batch is unchanged; the host waits only for tokens the device has already produced.

Rows that stay on the synchronous path (:attr:`Sampler.device_choice` is False, and one such row keeps
its whole step synchronous): logprobs (a host copy of the distribution per step), presence / frequency /
repetition penalties and ``logit_bias`` (history-dependent ops before the choice), ``min_tokens`` (stop
ids masked by count), and every custom sampler (the duplex policy, which batches its own draws).

Rules that keep the tokens exactly those of the synchronous path:

* A step is *deferred* (its tokens read on the next engine call) only when it is all decode rows,
  replayed from a graph, and every row's sampler has a device choice (:func:`deferrable`).
* Step n+1 is *chained* only when nothing may change the batch: no command waiting (commands apply
  only after the in-flight step is consumed, so a cancel or close sees the same state as in the
  synchronous path), no sequence waiting for admission, the running set is exactly step n's rows, no
  row can end at step n for length (max_tokens or the context limit: known on the host), and a graph
  for the new bucket already exists (:func:`chain_rows`). Otherwise the engine consumes step n and
  plans step n+1 as before.
* The only rows that step n+1 computes in vain are rows that ended at step n on a token: a stop id, a
  stop string, or a grammar that completed (it then allows only ``<|im_end|>``, a stop id). Their
  result is dropped (:meth:`InFlight.alive`), and their step n+1 gets no choice at all (:func:`settle`
  runs after step n is consumed and skips them), so no mask is filled for a finished grammar and no
  generator is advanced: a seeded or unseeded draw sequence is the synchronous one. Their key/value
  write lands at position ``len(tokens)``, which is inside the blocks they held when n+1 was queued
  (the length rule above keeps the position inside the admission reservation). If those blocks are freed
  when step n is consumed and handed to another sequence, that sequence's writes are queued after step
  n+1 on the same stream, and it only reads positions it has written itself; a persistent sequence
  rewrites that position before reading it.
* The grammar mask's pinned host buffer is refilled only after its previous upload has left it
  (:func:`services.thinker.constrained.mask_buffer`).

On by default; ``EngineConfig.overlap_decode=False`` turns it off (tests, the benchmark's other arm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.thinker.sampling import choose_on_device
from services.thinker.scheduler import Scheduler, SeqStatus, StepPlan, WorkItem
from services.thinker.step_types import DecodeRow, StepOutput

if TYPE_CHECKING:
    from services.thinker.row_graph import RowGraph
    from services.thinker.runner import ModelRunner


@dataclass
class Prefetched:
    """A step's tokens (and hidden rows) on their way to the host, queued right after its replay."""

    tokens: torch.Tensor  # [b] int64, host
    hidden: torch.Tensor | None  # [b, hidden], host
    ready: torch.cuda.Event | None  # None on CPU (already there)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def rows(self, index: list[int]) -> Prefetched:
        """The same prefetch restricted to rows ``index`` (after :meth:`wait`)."""
        pick = torch.tensor(index, dtype=torch.long)
        hidden = None if self.hidden is None else self.hidden.index_select(0, pick)
        return Prefetched(self.tokens.index_select(0, pick), hidden, None)


def prefetch(tokens: torch.Tensor, hidden: torch.Tensor | None) -> Prefetched:
    """Queue the copies to the host now, before anything that would overwrite the device buffers.

    On CUDA they go to pinned memory without a sync; on CPU they are clones (a graph's static buffers
    are rewritten by the next replay, and ``.to("cpu")`` of a CPU tensor would alias them).
    """
    if tokens.device.type != "cuda":
        return Prefetched(tokens.clone(), None if hidden is None else hidden.clone(), None)
    host_tokens = tokens.to("cpu", non_blocking=True)
    host_hidden = None if hidden is None else hidden.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Prefetched(host_tokens, host_hidden, ready)


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not consumed yet."""

    plan: StepPlan
    works: list[WorkItem]  # each row's work item when the step was launched
    positions: list[int]  # the position each row fed
    # The rows' tokens on the device: the graph's argmax, overwritten by :func:`settle` for rows that need
    # a mask or a draw (valid until that graph replays again).
    tokens_dev: torch.Tensor
    logits: torch.Tensor  # [rows, V] the step's logits (the graph's output buffer or an fp32 copy)
    hidden: torch.Tensor | None  # [rows, hidden] on the device when a row emits hidden rows
    host: Prefetched | None = None  # the tokens' copy to the host, queued by :func:`settle`
    timing: tuple = field(default=())  # (cuda events or None, t_forward, t0): the engine's step metrics

    def alive(self) -> list[int]:
        """Rows whose sequence still runs the work it had at launch, with the token this step fed."""
        out = []
        for i, (seq, work) in enumerate(zip(self.plan.decode, self.works, strict=True)):
            if seq.status is SeqStatus.RUNNING and seq.work is work and seq.next_token is not None:
                out.append(i)
        return out

    def output(self) -> StepOutput:
        """A StepOutput shell for the engine's consumer (tokens and hidden come from :attr:`host`)."""
        empty = torch.empty(0)
        return StepOutput(decode_hidden=empty, decode_logits=empty, prefill_logits=[])


def deferrable(plan: StepPlan, out: StepOutput) -> bool:
    """True when a launched step may be consumed on the next engine call (see the module rules)."""
    if not plan.decode or plan.prefill or out.greedy_tokens is None:
        return False
    for seq in plan.decode:
        work = seq.work
        if work is None or work.sampler is None or not work.sampler.device_choice:
            return False
        if seq.finishing is not None:
            return False
    return True


def chain_rows(
    inflight: InFlight, scheduler: Scheduler, max_context: int, commands_pending: bool
) -> list[DecodeRow] | None:
    """The rows of step n+1 if it can be launched before step n is consumed, else None.

    Token ids are placeholders: the replay takes them from ``inflight.tokens_dev``.
    """
    if commands_pending or scheduler.waiting:
        return None
    seqs = inflight.plan.decode
    if len(scheduler.running) != len(seqs) or set(scheduler.running) != set(seqs):
        return None
    rows = []
    for seq, work, pos in zip(seqs, inflight.works, inflight.positions, strict=True):
        if seq.status is not SeqStatus.RUNNING or seq.work is not work or seq.finishing is not None:
            return None
        if seq.prompt or seq.next_token is None or work.sampler is None:
            return None
        # After step n: len(generated) + 1 tokens drawn and pos + 1 tokens in the cache. A row that
        # would end for length there changes the batch (or feeds its last token once more): consume first.
        if len(seq.generated) + 1 >= work.sampler.max_new_tokens or pos + 1 >= max_context:
            return None
        if (pos + 1) // scheduler.layout.block_size >= len(seq.blocks):
            return None  # never write outside the blocks the sequence owns (the reservation covers it)
        rows.append(DecodeRow(0, pos + 1, seq.blocks))
    return rows


def launch_chained(runner: ModelRunner, rows: list[DecodeRow], ids_from: torch.Tensor) -> RowGraph | None:
    """Replay the captured graph of ``rows``' bucket with ids from ``ids_from``; None when not captured.

    Never captures: a capture runs eager warm-up passes and takes seconds, which the synchronous path
    (the one that captures today) handles.
    """
    if not runner.use_cuda_graphs:
        return None
    graph = runner._graph_for(len(rows), max(r.position for r in rows) + 1, capture=False)
    if graph is None:
        return None
    with torch.inference_mode():
        graph.run(rows, ids_from=ids_from)
    runner.count_step("graph")
    return graph


def launch_successor(runner: ModelRunner, inf: InFlight, rows: list[DecodeRow]) -> InFlight | None:
    """Launch step n+1 of ``inf``'s rows (:func:`chain_rows`); its choice and copy come from :func:`settle`."""
    graph = launch_chained(runner, rows, inf.tokens_dev)
    if graph is None:
        return None
    b = len(rows)
    emit = any(s.work is not None and s.work.emit_hidden for s in inf.plan.decode)
    return InFlight(
        inf.plan,
        inf.works,
        [r.position for r in rows],
        graph.tokens[:b],
        graph.logits[:b],
        graph.hidden[:b] if emit else None,
    )


def settle(inf: InFlight) -> None:
    """Queue the choice of ``inf``'s live rows behind its replay, then its tokens' copy to the host.

    Only rows still running the work they had at launch are chosen (:meth:`InFlight.alive`): a row that
    ended on step n's token gets no mask fill and no draw for its in-vain step n+1. Call it once the
    previous step is consumed, so every grammar has taken the token it is one step behind.
    """
    live = inf.alive()
    samplers = [inf.works[i].sampler for i in live]
    if any(s is not None and not s.batchable_greedy for s in samplers):
        # the graph's buffers are inference tensors: writing into them needs inference mode, whichever
        # thread (the engine's, or a bench calling step() directly) runs this
        with torch.inference_mode():
            choose_on_device(samplers, inf.logits, live, inf.tokens_dev)  # type: ignore[arg-type]
    inf.host = prefetch(inf.tokens_dev, inf.hidden)


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``t`` on the host and, for a GPU tensor, the event after which the copy has landed.

    A GPU tensor is copied into pinned memory without a stream sync, so the step syncs once (when its
    tokens come back) instead of once for the hidden rows and again for the tokens; each sync is also a
    point where the engine thread must win the GIL back from the encode and event-loop threads.
    """
    if t.device.type != "cuda":
        return t.to("cpu"), None
    host = t.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
