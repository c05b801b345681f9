"""Continuous-batching scheduler: who runs this step, how many prompt tokens each gets, who waits.

Pure bookkeeping (no tensors): the engine asks for a :class:`StepPlan`, runs it, and reports back.

Policy, in order, under a per-step token budget, always most urgent first (:func:`urgency`):

1. every running sequence that has a sampled token to feed decodes (one token each);
2. running sequences with prompt left get prefill chunks from the remaining budget;
3. waiting sequences are admitted while their KV reservation fits in the block pool.

Urgency is earliest deadline first: a duplex unit carries the time by which its decision is due (its
arrival plus the 1 s unit period: later, the session's audio underruns), so when the engine is
saturated (more waiting sequences than free slots, or more prompt than the step budget) the unit closest
to an underrun is served first. Work without a deadline (chat requests, session prefixes) follows the
deadlined work, oldest first among itself.

KV admission: a sequence reserves blocks for ``context + new input + reserve_tokens`` (its sampler's
max_new_tokens, more for a duplex unit that may make a function call; capped at the
context limit) when it is admitted, so a running sequence can never run out of cache mid-decode and
the pool, sized from the byte budget, bounds the gauge by construction. A request that does not fit
waits (head of line); one that could never fit is rejected by the engine before it is queued.
Persistent sequences (duplex sessions) keep their blocks between work items and give back the unused
reservation when an item ends.

Automatic prefix caching (when the pool has it on): a fresh sequence's prompt is hashed block by block
at enqueue (:mod:`services.thinker.prefix_hash`); at admission the longest run of those hashes the pool
still holds becomes the head of its block table (shared, reference-counted), its tokens count as already
in the cache and only the rest is prefilled. The hit stops one block short when the prompt ends on a
block boundary, so at least one token is computed and its logits exist. Every block a sequence fills
is registered as soon as it is full (:meth:`Scheduler.commit_blocks`), so requests that arrive while
the first one still runs share what it has computed. A full block is never written again, which is
why sharing needs no copy-on-write: the partial last block of every sequence is always its own.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from services.thinker.kv_cache import BlockPool, KVLayout
from services.thinker.prefix_hash import MediaSpan, block_hash, chain_hashes
from services.thinker.sampling import Sampler


class SeqStatus(Enum):
    WAITING = "waiting"  # has work, waits for admission (KV reservation)
    RUNNING = "running"  # admitted: prefilling or decoding
    IDLE = "idle"  # persistent sequence between work items (holds its KV)
    FINISHED = "finished"  # blocks released


@dataclass
class WorkItem:
    """Tokens to append to a sequence, then (optionally) a generation.

    ``embeds`` (``[n, hidden]``, ``n <= len(token_ids)``) replaces the text embeddings of the first ``n``
    rows when the prompt carries image/audio features; rows past ``n`` are text, embedded from their ids
    (a registered voice's prefix is the only embedded part of a speech prompt). ``sampler`` None means
    prefill only (a duplex session prefix).
    """

    token_ids: list[int]
    embeds: torch.Tensor | None = None
    sampler: Sampler | None = None
    emit_hidden: bool = False
    # At a "length" finish, feed the last sampled token once more so its hidden row exists (span export).
    feed_last: bool = False
    tag: object = None  # opaque to the engine (duplex: unit seq / epoch), echoed in events
    # time.perf_counter() by which the item's result is due (a duplex unit: arrival + the unit period);
    # None: no deadline (best effort after deadlined work)
    deadline: float | None = None
    # Teacher-forced speech: emit the final-norm hidden rows of ``token_ids[export_from:]`` as they are
    # prefilled (events carry ``prompt_rows``); None exports nothing.
    export_from: int | None = None
    # Rows of token_ids embedded from media, keyed by the media's content digest (prefix caching). With
    # ``embeds`` and no ``media`` the rows cannot be named and nothing from this item on is cached.
    media: list[MediaSpan] | None = None


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """One KV owner: a turn-mode request or a duplex session."""

    persistent: bool = False
    sink: Callable[..., None] | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.IDLE
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    work: WorkItem | None = None
    # Work in progress
    prompt: list[int] = field(default_factory=list)  # input tokens not yet fed
    prompt_embeds: torch.Tensor | None = None
    prompt_offset: int = 0  # rows of work.token_ids already fed
    next_token: int | None = None  # sampled, not yet fed
    generated: list[int] = field(default_factory=list)
    finishing: str | None = None  # finish reason held while feed_last runs
    submitted_at: float = 0.0
    first_token_at: float | None = None
    # Prefix caching: media spans (absolute positions), hashes of the full blocks registered so far,
    # the first position that has no key (None: all keyed), the prompt's lookup hashes (fresh sequences)
    # and how many tokens of the current work item came from the cache.
    media: list[MediaSpan] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    hash_limit: int | None = None
    prompt_hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def context_len(self) -> int:
        return len(self.tokens)

    @property
    def wants_decode(self) -> bool:
        return self.status is SeqStatus.RUNNING and not self.prompt and self.next_token is not None

    @property
    def wants_prefill(self) -> bool:
        return self.status is SeqStatus.RUNNING and bool(self.prompt)

    def reservation_tokens(self, max_context: int) -> int:
        """Cache positions this sequence may need until its current work item ends."""
        if self.work is None:
            return len(self.tokens)
        new = len(self.prompt) + (self.work.sampler.reserve_tokens if self.work.sampler else 0)
        return min(len(self.tokens) + new, max_context)


def urgency(seq: Sequence) -> tuple[bool, float, float]:
    """Sort key, most urgent first: deadlined work by deadline, then the rest by submission time."""
    deadline = seq.work.deadline if seq.work is not None else None
    return (deadline is None, deadline if deadline is not None else 0.0, seq.submitted_at)


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    """Owns the waiting queue, the running set and the block pool's accounting."""

    def __init__(
        self, pool: BlockPool, layout: KVLayout, *, max_context: int, max_num_seqs: int, max_step_tokens: int
    ) -> None:
        self.pool = pool
        self.layout = layout
        self.max_context = max_context
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Prompt tokens of admitted work items taken from the prefix cache / computed (engine metrics).
        self.hit_tokens = 0
        self.miss_tokens = 0

    @property
    def prefix_caching(self) -> bool:
        return self.pool.prefix_caching

    # ------------------------------------------------------------------------------------ lifecycle
    def enqueue(self, seq: Sequence, work: WorkItem) -> None:
        """Give ``seq`` a work item; it waits for admission (its reservation may grow)."""
        seq.work = work
        seq.prompt = list(work.token_ids)
        seq.prompt_embeds = work.embeds
        seq.prompt_offset = 0
        seq.next_token = None
        seq.generated = []
        seq.finishing = None
        seq.first_token_at = None
        seq.cached_tokens = 0
        seq.prompt_hashes = []
        base = len(seq.tokens)
        if work.media is not None:
            seq.media.extend(span.shifted(base) for span in work.media)
        elif work.embeds is not None and seq.hash_limit is None:
            seq.hash_limit = base  # rows we cannot name: no block from here on is shared
        if self.prefix_caching and base == 0 and seq.hash_limit is None:
            # At least one prompt token stays to compute, so the hit ends at len - 1 at most; rows a
            # work item exports (teacher-forced speech) must be computed, so the hit ends before them.
            limit = len(seq.prompt) - 1
            if work.export_from is not None:
                limit = min(limit, work.export_from)
            seq.prompt_hashes = chain_hashes(seq.prompt, self.layout.block_size, seq.media, limit=limit)
        seq.submitted_at = time.perf_counter()
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def can_ever_fit(self, tokens: int) -> bool:
        return self.layout.blocks_for(tokens) <= self.pool.capacity

    def end_work(self, seq: Sequence) -> None:
        """The current work item is over (finished or cancelled): idle a session, free a request."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.work = None
        seq.prompt = []
        seq.prompt_embeds = None
        seq.next_token = None
        if seq.persistent:
            keep = self.layout.blocks_for(len(seq.tokens))
            if len(seq.blocks) > keep:
                self.pool.release(seq.blocks[keep:])
                seq.blocks = seq.blocks[:keep]
            seq.status = SeqStatus.IDLE
        else:
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Drop a sequence entirely and give its blocks back at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks = []
        seq.work = None
        seq.status = SeqStatus.FINISHED

    # ----------------------------------------------------------------------------------------- plan
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = min(self.waiting, key=urgency)
            hit = self.pool.lookup(seq.prompt_hashes) if seq.prompt_hashes and not seq.tokens else []
            need = (
                self.layout.blocks_for(seq.reservation_tokens(self.max_context)) - len(seq.blocks) - len(hit)
            )
            if need > self.pool.free_blocks - self.pool.unheld(hit):
                return  # less urgent work does not overtake the most urgent one waiting for memory
            if hit:
                self.pool.acquire(hit)
                seq.blocks.extend(hit)
                self._take_hit(seq, len(hit))
            if need > 0:
                seq.blocks.extend(self.pool.allocate(need))
            self.hit_tokens += seq.cached_tokens
            self.miss_tokens += len(seq.prompt)
            seq.prompt_hashes = []
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _take_hit(self, seq: Sequence, blocks: int) -> None:
        """The first ``blocks`` blocks of the prompt are in the cache: count them as fed."""
        n = blocks * self.layout.block_size
        seq.tokens.extend(seq.prompt[:n])
        seq.prompt = seq.prompt[n:]
        seq.prompt_offset = n
        seq.block_hashes = seq.prompt_hashes[:blocks]
        seq.cached_tokens = n

    def commit_blocks(self, seq: Sequence) -> None:
        """Register every block of ``seq`` that became full (and is keyed) in the prefix index."""
        if not self.prefix_caching:
            return
        bs = self.layout.block_size
        end = len(seq.tokens) if seq.hash_limit is None else min(len(seq.tokens), seq.hash_limit)
        for b in range(len(seq.block_hashes), end // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            h = block_hash(parent, seq.tokens[b * bs : (b + 1) * bs], b * bs, seq.media)
            self.pool.register(seq.blocks[b], h)
            seq.block_hashes.append(h)

    def plan(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        budget = self.max_step_tokens
        ordered = sorted(self.running, key=urgency)
        for seq in ordered:
            if seq.wants_decode and budget > 0:
                plan.decode.append(seq)
                budget -= 1
        for seq in ordered:
            if budget <= 0:
                break
            if seq.wants_prefill:
                n = min(len(seq.prompt), budget)
                plan.prefill.append((seq, n))
                budget -= n
        return plan

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)
