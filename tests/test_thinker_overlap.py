"""Overlapped decode (services.thinker.overlap) on the tiny checkpoint, CPU fp32, CUDA graphs emulated:
the same events (tokens, fed tokens, finish reasons, hidden rows) as the synchronous graph engine while
rows stop on a stop id mid-run, stop for length, get cancelled, a prefill joins and a new request takes
over freed blocks; steps really are chained; the off switch works.

Rows chosen on the device too: grammar rows (llguidance masks filled one step behind, masked argmax or
masked draw queued behind the replay) and temperature rows (seeded draws), next to plain greedy rows,
with grammars that complete mid-run (the row stops on <|im_end|>, or with no stop id goes on under an
EOS-only mask), a grammar in its error state, a cancel and joins: the same events as with overlap off,
and the device choice equals the host sampler's choice row for row. Logprobs, penalties, logit_bias and
min_tokens rows keep their step synchronous."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.common.pb import thinker_pb2
from services.thinker.constrained import COMPACT, IM_END_ID, TOOL_CALL_ID, GrammarCompiler
from services.thinker.engine import EngineConfig, EngineEvent, ThinkerEngine
from services.thinker.runner import build_qwen3_llm
from services.thinker.sampling import (
    DEFAULT_STOP_IDS,
    Sampler,
    SamplingConfig,
    choose_on_device,
    choose_tokens,
)
from services.thinker.scheduler import Sequence, WorkItem
from tests.graph_emulation import emulated
from tests.test_thinker_constrained import SCHEMA

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
    torch.manual_seed(1234)  # unseeded draws use the global generator: the same sequence in both runs
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


def test_host_chosen_rows_and_the_off_switch_never_chain(llm: torch.nn.Module) -> None:
    """A row whose choice needs the host (logprobs, penalties, logit_bias, min_tokens) keeps every step of
    its batch synchronous, next to greedy and sampled rows; the tokens are those of overlap off."""
    host_rows = [
        SamplingConfig(max_tokens=8, logprobs=True, top_logprobs=2, stop_token_ids=()),
        SamplingConfig(max_tokens=8, presence_penalty=1.0, stop_token_ids=()),
        SamplingConfig(max_tokens=8, repetition_penalty=1.2, stop_token_ids=()),
        SamplingConfig(max_tokens=8, logit_bias=((5, 2.0),), stop_token_ids=()),
        SamplingConfig(max_tokens=8, min_tokens=4, stop_token_ids=(7,)),
    ]
    for cfg in host_rows:
        assert not Sampler(cfg).device_choice

        def script(cfg: SamplingConfig = cfg) -> Script:
            sampled = SamplingConfig(max_tokens=8, temperature=0.7, seed=3, stop_token_ids=())
            return {
                0: [
                    ("submit", 0, WorkItem(PROMPTS[0], sampler=greedy(8))),
                    ("submit", 1, WorkItem(PROMPTS[1], sampler=Sampler(sampled))),
                    ("submit", 2, WorkItem(PROMPTS[2], sampler=Sampler(cfg))),
                ]
            }

        over, chained = run(llm, True, script())
        assert chained == 0, cfg  # every step stays synchronous
        sync, _ = run(llm, False, script())
        assert_same(sync, over)
    assert Sampler(SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=1)).device_choice
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
        works = [s.work for s in seqs if s.work is not None]
        return InFlight(
            StepPlan(decode=list(seqs)), works, positions, torch.zeros(2), torch.zeros(2, 8), None, empty
        )

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


# ------------------------------------------------------------------------------ rows chosen on the device
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}}}
]
Kind = thinker_pb2.Constraint.Kind


@pytest.fixture(scope="module")
def compiler(tiny_ckpt: Path) -> GrammarCompiler:
    tokenizer = Checkpoint(tiny_ckpt).tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def grammars(compiler: GrammarCompiler) -> dict[str, str]:
    # Objects one per line, then a lexeme of the empty language: the grammar never completes.
    endless = {**SCHEMA, "x-guidance": COMPACT}
    return {
        "schema": compiler.grammar(
            thinker_pb2.Constraint(kind=Kind.KIND_JSON_SCHEMA, spec=json.dumps(SCHEMA))
        ),
        "object": compiler.grammar(thinker_pb2.Constraint(kind=Kind.KIND_JSON_OBJECT)),
        "tools": compiler.grammar(thinker_pb2.Constraint(kind=Kind.KIND_TOOL_CALLS, spec=json.dumps(TOOLS))),
        "endless": "start: item+ NEVER\nNEVER: /[^\\s\\S]/\nitem: %json" + json.dumps(endless) + ' "\\n"\n',
    }


def ruled(compiler: GrammarCompiler, grammar: str, max_tokens: int, **kw: Any) -> Sampler:
    """A sampler under ``grammar`` (default stop ids unless ``stop_token_ids`` says otherwise)."""
    kw.setdefault("stop_token_ids", DEFAULT_STOP_IDS)
    sampler = Sampler(SamplingConfig(max_tokens=max_tokens, **kw))
    sampler.constraint = compiler.from_grammar(grammar)
    return sampler


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [e.token for e in events if e.token is not None]


def test_grammar_and_sampled_rows_chain_and_match_the_synchronous_engine(
    llm: torch.nn.Module, compiler: GrammarCompiler, grammars: dict[str, str]
) -> None:
    def script() -> Script:
        broken = ruled(compiler, grammars["schema"], 10, stop_token_ids=())
        broken.constraint.accept(IM_END_ID)  # type: ignore[union-attr]  # <|im_end|> before "{": error state
        assert broken.constraint.failed  # type: ignore[union-attr]
        return {
            0: [
                # completes mid-run and stops on <|im_end|> (a stop id): its in-vain step is dropped
                (
                    "submit",
                    0,
                    WorkItem(PROMPTS[0], sampler=ruled(compiler, grammars["schema"], 60), emit_hidden=True),
                ),
                ("submit", 1, WorkItem(PROMPTS[1], sampler=greedy(24), emit_hidden=True)),  # unconstrained
                # completes mid-run with no stop id: an EOS-only mask until max_tokens
                (
                    "submit",
                    2,
                    WorkItem(PROMPTS[2], sampler=ruled(compiler, grammars["schema"], 40, stop_token_ids=())),
                ),
                # a masked draw from its own generator
                (
                    "submit",
                    3,
                    WorkItem(
                        PROMPTS[3],
                        sampler=ruled(
                            compiler, grammars["tools"], 50, temperature=0.9, seed=5, top_k=40, top_p=0.9
                        ),
                    ),
                ),
                # a plain seeded draw
                (
                    "submit",
                    4,
                    WorkItem(
                        PROMPTS[4],
                        sampler=Sampler(
                            SamplingConfig(
                                max_tokens=30, temperature=1.0, top_p=0.8, seed=11, stop_token_ids=()
                            )
                        ),
                    ),
                ),
                # unseeded draws (the global generator), one of which ends mid-run on a stop id: its in-vain
                # step draws nothing, or the other's later draws would differ from the synchronous ones
                (
                    "submit",
                    8,
                    WorkItem(
                        PROMPTS[3][:10], sampler=ruled(compiler, grammars["tools"], 50, temperature=0.9)
                    ),
                ),
                (
                    "submit",
                    9,
                    WorkItem(
                        PROMPTS[4][:10],
                        sampler=Sampler(SamplingConfig(max_tokens=40, temperature=1.0, stop_token_ids=())),
                    ),
                ),
                (
                    "submit",
                    5,
                    WorkItem(PROMPTS[0][:9], sampler=ruled(compiler, grammars["endless"], 200)),
                ),  # cancelled
            ],
            6: [("submit", 6, WorkItem(PROMPTS[1][:12], sampler=broken))],  # joins, in the error state
            12: [("cancel", 5, None)],
            # after request 0 stopped: a masked draw takes over freed blocks
            26: [
                (
                    "submit",
                    7,
                    WorkItem(
                        PROMPTS[2][:8],
                        sampler=ruled(compiler, grammars["object"], 20, temperature=0.8, seed=2),
                    ),
                )
            ],
        }

    sync, chained_off = run(llm, False, script())
    over, chained_on = run(llm, True, script())
    assert chained_off == 0 and chained_on > 25, (chained_off, chained_on)
    assert_same(sync, over)
    tokenizer = compiler.ll_tokenizer
    # The grammars really ruled the chained rows (tokens equal to the synchronous engine's, which applies
    # the masks on the host path).
    first = tokens_of(over[0])
    assert over[0][-1].finish_reason == "stop" and first[-1] == IM_END_ID and len(first) < 60
    text = tokenizer.decode_str(first[:-1])
    assert json.loads(text)["unit"] in ("c", "f") and text == json.dumps(
        json.loads(text), separators=(",", ":")
    )
    done = tokens_of(over[2])
    assert over[2][-1].finish_reason == "length" and len(done) == 40
    end = done.index(IM_END_ID)
    assert set(done[end:]) == {IM_END_ID} and end < 30  # completed mid-run, then only <|im_end|>
    json.loads(tokenizer.decode_str(done[:end]))
    assert tokens_of(over[3])[0] == TOOL_CALL_ID
    assert over[4][-1].finish_reason == "length" and len(tokens_of(over[4])) == 30
    assert over[5][-1].finish_reason == "cancelled"
    assert tokens_of(over[6]) == [IM_END_ID] * 10 and over[6][-1].finish_reason == "length"
    assert over[7][-1].finish_reason in ("stop", "length") and tokens_of(over[7])[0] != IM_END_ID
    unseeded_call, unseeded_free = tokens_of(over[8]), tokens_of(over[9])
    assert over[8][-1].finish_reason == "stop" and len(unseeded_call) < 40 and len(unseeded_free) == 40


def test_a_constrained_batch_chains_every_steady_step(
    llm: torch.nn.Module, compiler: GrammarCompiler, grammars: dict[str, str]
) -> None:
    """Greedy rows under grammars that cannot end: after the prefill step and the first deferred one,
    every engine call launches its successor before reading its tokens."""

    def script() -> Script:
        return {
            0: [
                ("submit", i, WorkItem(p, sampler=ruled(compiler, grammars["endless"], 24)))
                for i, p in enumerate(PROMPTS[:4])
            ]
        }

    over, chained = run(llm, True, script())
    sync, _ = run(llm, False, script())
    assert_same(sync, over)
    assert all(len(tokens_of(ev)) == 24 for ev in over)
    assert chained >= 24 - 4, chained  # prompt step, first deferred step, the last step is consumed


def test_device_choice_equals_the_host_choice(compiler: GrammarCompiler, grammars: dict[str, str]) -> None:
    """choose_on_device on the graph's buffers gives choose_tokens' tokens, step after step, with the
    grammars advanced by the tokens (a plain greedy row keeps the buffer's argmax)."""

    def samplers() -> list[Sampler]:
        return [
            Sampler(SamplingConfig()),
            ruled(compiler, grammars["schema"], 99),
            Sampler(SamplingConfig(temperature=0.7, top_k=50, seed=1)),
            ruled(compiler, grammars["object"], 99, temperature=1.2, top_p=0.9, seed=2),
            ruled(compiler, grammars["tools"], 99),
        ]

    host_side, device_side = samplers(), samplers()
    vocab = compiler.vocab_size + 40  # the lm_head may be wider than the tokenizer: masked off beyond it
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        # The graph's logits: bf16 on a GPU (the host path reads their fp32 copy), a transposed view with
        # the swapped lm_head.
        logits = torch.randn(len(host_side), vocab, generator=gen) * 4
        if step % 3 == 2:
            logits = logits.bfloat16()
        want = choose_tokens(host_side, logits.float(), [[]] * len(host_side), [0] * len(host_side))
        buf = logits.argmax(dim=-1)  # what the graph leaves in its token buffer
        rows = list(range(len(device_side)))
        if step % 3:
            logits = logits.t().contiguous().t()
        choose_on_device(device_side, logits, rows, buf)
        got = buf.tolist()
        for s, t in zip(device_side, got, strict=True):
            s.accept(t)
        assert got == want
        assert all(t < compiler.vocab_size for t in got[1:2] + got[3:])


def test_a_capture_after_warm_up_is_logged_as_a_stall(
    llm: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    """Graphs warmed up to 256 tokens: a decode past them captures its bucket while serving, which
    stalls every stream of the step, so it is logged as a warning; decodes inside the warmed range
    capture nothing."""
    engine = graphed_engine(llm, overlap=False)
    warmed = set(engine.runner._graphs)

    def decode(prompt_len: int) -> None:
        seq = engine.open(lambda ev: None)
        engine.submit(seq, WorkItem(list(range(100, 100 + prompt_len)), sampler=greedy(3)))
        engine.run_until_idle()

    def runner_warnings() -> list[logging.LogRecord]:
        # The runner's own (a capture while serving); a slow-step warning depends on the machine's speed.
        return [
            r for r in caplog.records if r.name == "services.thinker.runner" and r.levelno >= logging.WARNING
        ]

    with caplog.at_level(logging.INFO, logger="services.thinker.runner"):
        decode(40)  # a 40-token prefill: a packed step in the warmed 64-row bucket
        assert set(engine.runner._graphs) == warmed
        assert not runner_warnings()
        decode(300)
    [late] = runner_warnings()
    assert "while serving" in late.getMessage() and "context=512" in late.getMessage()
    assert set(engine.runner._graphs) - warmed
