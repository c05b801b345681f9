"""The thinker scheduler serves the work closest to its deadline first when the engine is saturated.

Pure bookkeeping (services/thinker/scheduler.py): no model, no timing. Duplex units carry the time their
decision is due (arrival + the 1 s unit period, services/thinker/duplex_stream.py); chat requests carry
none and follow deadlined work.
"""

from __future__ import annotations

import torch

from services.thinker.kv_cache import BlockPool, KVLayout
from services.thinker.scheduler import Scheduler, SeqStatus, Sequence, WorkItem


def _scheduler(max_num_seqs: int, max_step_tokens: int = 512) -> Scheduler:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16)
    return Scheduler(
        BlockPool(256), layout, max_context=4096, max_num_seqs=max_num_seqs, max_step_tokens=max_step_tokens
    )


def _enqueue(sched: Scheduler, tokens: int, deadline: float | None) -> Sequence:
    seq = Sequence(persistent=deadline is not None)
    sched.enqueue(seq, WorkItem(list(range(tokens)), deadline=deadline))
    return seq


def test_a_saturated_engine_admits_the_unit_closest_to_its_deadline_first() -> None:
    sched = _scheduler(max_num_seqs=1)
    chat = _enqueue(sched, 10, None)  # submitted first, no deadline
    late = _enqueue(sched, 10, deadline=105.0)
    urgent = _enqueue(sched, 10, deadline=101.0)
    plan = sched.plan()
    assert [s for s, _ in plan.prefill] == [urgent]
    assert urgent.status is SeqStatus.RUNNING and late.status is SeqStatus.WAITING
    sched.end_work(urgent)
    assert [s for s, _ in sched.plan().prefill] == [late]
    sched.end_work(late)
    assert [s for s, _ in sched.plan().prefill] == [chat]  # best effort still runs once nothing is due


def test_the_step_budget_goes_to_the_most_urgent_prompt_first() -> None:
    sched = _scheduler(max_num_seqs=8, max_step_tokens=16)
    chat = _enqueue(sched, 12, None)
    later = _enqueue(sched, 12, deadline=50.0)
    sooner = _enqueue(sched, 12, deadline=20.0)
    plan = sched.plan()
    assert {s.status for s in (chat, later, sooner)} == {SeqStatus.RUNNING}  # all admitted, budget is short
    assert plan.prefill == [(sooner, 12), (later, 4)]
    for seq, n in plan.prefill:  # what the engine does after the forward pass
        seq.tokens.extend(seq.prompt[:n])
        seq.prompt = seq.prompt[n:]
    plan = sched.plan()  # the next step: the rest of the later unit, then the chat prompt
    assert plan.prefill[0] == (later, 8) and plan.prefill[1][0] is chat


def test_without_deadlines_the_order_stays_first_come_first_served() -> None:
    sched = _scheduler(max_num_seqs=1)
    first, second = _enqueue(sched, 4, None), _enqueue(sched, 4, None)
    assert [s for s, _ in sched.plan().prefill] == [first]
    sched.end_work(first)
    assert [s for s, _ in sched.plan().prefill] == [second]
