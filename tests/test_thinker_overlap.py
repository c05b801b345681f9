"""Overlapped decode (services.thinker.overlap) on the tiny checkpoint, CPU fp32, CUDA graphs emulated:
the same events (tokens, fed tokens, finish reasons, hidden rows) as the synchronous graph engine while
rows stop on a stop id mid-run, stop for length, get cancelled, a prefill joins and a new request takes
over freed blocks; steps really are chained; the off switch works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.thinker.engine import EngineConfig, EngineEvent, ThinkerEngine
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import Sampler, SamplingConfig
from services.thinker.scheduler import Sequence, WorkItem
from tests.graph_emulation import emulated

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llm(tiny_ckpt: Path) -> torch.nn.Module:
    ckpt = Checkpoint(tiny_ckpt)
    tensors = ckpt.load_tensors(["llm."], strip_prefix="llm.", dtype=torch.float32)
    return build_qwen3_llm(ckpt.config, tensors, torch.float32, "cpu")


def greedy(max_tokens: int, stop: tuple[int, ...] = ()) -> Sampler:
    return Sampler(SamplingConfig(max_tokens=max_tokens, stop_token_ids=stop))


def graphed_engine(llm: torch.nn.Module, overlap: bool) -> ThinkerEngine:
    engine = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20, overlap_decode=overlap), "cpu")
    engine.runner.use_cuda_graphs = True
    engine.runner.graph_capture = emulated
    engine.runner.warmup_graphs(4, 64, 16)
    return engine


Script = dict[int, list[tuple[str, int, WorkItem | None]]]  # engine call -> (command, request, work)


def run(llm: torch.nn.Module, overlap: bool, script: Script) -> tuple[list[list[EngineEvent]], int]:
    """Drive the engine call by call, applying ``script``'s commands before the given call."""
    engine = graphed_engine(llm, overlap)
    sinks: dict[int, list[EngineEvent]] = {}
    seqs = {}
    call = 0
    while True:
        for kind, key, work in script.get(call, []):
            if kind == "submit":
                assert work is not None
                sinks[key] = []
                seqs[key] = engine.open(sinks[key].append)
                engine.submit(seqs[key], work)
            else:
                engine.cancel(seqs[key])
        did = engine.step()
        call += 1
        if not did and engine.is_idle() and call > max(script):
            break
        assert call < 500
    return [sinks[k] for k in sorted(sinks)], engine.chained_steps


def summary(events: list[EngineEvent]) -> list[tuple[int | None, int | None, str | None]]:
    return [(e.token, e.fed_token, e.finish_reason) for e in events]


def assert_same(sync: list[list[EngineEvent]], over: list[list[EngineEvent]]) -> None:
    for s, o in zip(sync, over, strict=True):
        assert summary(o) == summary(s)
        hs = [e.hidden for e in s if e.hidden is not None]
        ho = [e.hidden for e in o if e.hidden is not None]
        assert len(hs) == len(ho)
        for a, b in zip(hs, ho, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)


PROMPTS = [list(range(1000 + 41 * i, 1000 + 41 * i + n)) for i, n in enumerate((17, 29, 11, 23, 13))]


def test_overlap_matches_sync_with_stops_cancel_and_joins(llm: torch.nn.Module) -> None:
    # First the free-running greedy output of request 0, to stop it on a token it really produces mid-run.
    free, _ = run(llm, False, {0: [("submit", 0, WorkItem(PROMPTS[0], sampler=greedy(16)))]})
    toks = [e.token for e in free[0] if e.token is not None]
    stop_at = next(i for i in range(4, len(toks)) if toks[i] not in toks[:i])
    stop_id = toks[stop_at]

    def script() -> Script:
        return {
            0: [
                ("submit", 0, WorkItem(PROMPTS[0], sampler=greedy(16, (stop_id,)), emit_hidden=True)),
                ("submit", 1, WorkItem(PROMPTS[1], sampler=greedy(9))),  # length stop mid-run
                ("submit", 2, WorkItem(PROMPTS[2], sampler=greedy(30), emit_hidden=True)),  # cancelled
            ],
            6: [("submit", 3, WorkItem(PROMPTS[3], sampler=greedy(12), emit_hidden=True))],  # prefill joins
            14: [("cancel", 2, None)],
            # after request 0 stopped (its blocks are free again): a new request may reuse them
            18: [("submit", 4, WorkItem(PROMPTS[4], sampler=greedy(10), emit_hidden=True))],
        }

    sync, chained_off = run(llm, False, script())
    over, chained_on = run(llm, True, script())
    assert chained_off == 0 and chained_on > 10, (chained_off, chained_on)
    assert sync[0][-1].finish_reason == "stop" and sync[0][-1].token == stop_id
    assert len([e for e in sync[0] if e.token is not None]) == stop_at + 1
    assert sync[1][-1].finish_reason == "length"
    assert sync[2][-1].finish_reason == "cancelled"
    assert all(s[-1].finish_reason in ("stop", "length") for s in (sync[3], sync[4]))
    assert_same(sync, over)


def test_overlap_tokens_equal_the_eager_engine(llm: torch.nn.Module) -> None:
    """Chained steps feed the device-side argmax: the tokens are the eager engine's (no graph at all)."""
    eager = ThinkerEngine(llm, EngineConfig(kv_budget_bytes=8 << 20), "cpu")
    sinks: list[list[EngineEvent]] = []
    for p in PROMPTS[:3]:
        sinks.append([])
        eager.submit(eager.open(sinks[-1].append), WorkItem(p, sampler=greedy(12), emit_hidden=True))
    eager.run_until_idle()
    over, chained = run(
        llm,
        True,
        {
            0: [
                ("submit", i, WorkItem(p, sampler=greedy(12), emit_hidden=True))
                for i, p in enumerate(PROMPTS[:3])
            ]
        },
    )
    assert chained >= 8
    assert_same(sinks, over)


def test_non_greedy_rows_and_the_off_switch_never_chain(
    llm: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampled = Sampler(SamplingConfig(max_tokens=8, temperature=0.7, seed=3, stop_token_ids=()))
    _, chained = run(
        llm,
        True,
        {
            0: [
                ("submit", 0, WorkItem(PROMPTS[0], sampler=greedy(8))),
                ("submit", 1, WorkItem(PROMPTS[1], sampler=sampled)),
            ]
        },
    )
    assert chained == 0  # a host-sampled row in the batch: every step stays synchronous
    assert not graphed_engine(llm, False).overlap and graphed_engine(llm, True).overlap


def test_chain_rules_refuse_every_batch_change() -> None:
    """chain_rows (pure bookkeeping): the next positions inside owned blocks, or None on any change."""
    from services.thinker.kv_cache import BlockPool, KVLayout
    from services.thinker.overlap import InFlight, Prefetched, chain_rows
    from services.thinker.scheduler import Scheduler, StepPlan

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16)
    sched = Scheduler(BlockPool(64), layout, max_context=64, max_num_seqs=4, max_step_tokens=64)
    seqs = []
    for n in (15, 20):  # prompt lengths; the first row's next position crosses into its second block
        seq = Sequence()
        sched.enqueue(seq, WorkItem(list(range(n)), sampler=greedy(8)))
        seqs.append(seq)
    sched.plan()
    for seq in seqs:  # as the engine leaves them after the prompt: fed, one token drawn
        seq.tokens, seq.prompt, seq.generated, seq.next_token = list(seq.prompt), [], [7], 7
    empty = Prefetched(torch.zeros(2, dtype=torch.long), None, None)

    def inflight() -> InFlight:
        positions = [len(s.tokens) for s in seqs]
        return InFlight(StepPlan(decode=list(seqs)), [s.work for s in seqs], positions, torch.zeros(2), empty)  # type: ignore[misc]

    rows = chain_rows(inflight(), sched, 64, commands_pending=False)
    assert rows is not None and [r.position for r in rows] == [16, 21]
    assert all(r.blocks is s.blocks for r, s in zip(rows, seqs, strict=True))
    assert chain_rows(inflight(), sched, 64, commands_pending=True) is None  # a command consumes first
    assert chain_rows(inflight(), sched, 21, commands_pending=False) is None  # context limit at step n
    seqs[1].generated = list(range(7))  # 7 drawn, max_tokens 8: step n draws the last one
    assert chain_rows(inflight(), sched, 64, commands_pending=False) is None
    seqs[1].generated = [7]
    blocks, seqs[0].blocks = seqs[0].blocks, seqs[0].blocks[:1]  # position 16 would leave its blocks
    assert chain_rows(inflight(), sched, 64, commands_pending=False) is None
    seqs[0].blocks = blocks
    late = Sequence()
    sched.enqueue(late, WorkItem([1, 2, 3], sampler=greedy(4)))  # someone waits for admission
    assert chain_rows(inflight(), sched, 64, commands_pending=False) is None
