"""Function calls in duplex mode (tiny checkpoint, CPU): the call grammar inside the listen/speak policy.

A forced call (``tool_choice`` required or named) is the whole model turn of the unit that asks for the
answer: ``<|speak|>``, one ``<tool_call>`` block whose arguments follow the schema (whatever the random
weights), then ``<|turn_eos|>`` and ``<|listen|>``; it is reported on the UnitResult, not spoken. The
offered tools and the client's function results enter the context as the chat template's messages. An
``auto`` call starts when the policy draws ``<tool_call>`` and is completed under the grammar.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from test_thinker_duplex import END, _session, duplex_open, unit

from services.common.pb import thinker_pb2
from services.thinker.backend import build_backend
from services.thinker.constrained import TOOL_CALL_END_ID, TOOL_CALL_ID, GrammarCompiler
from services.thinker.duplex import call_bounds, select_span
from services.thinker.duplex_policy import (
    CALL_UNIT_TOKENS,
    LISTEN,
    SPEAK,
    TURN_EOS,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
    ToolCallPlan,
)
from services.thinker.engine import EngineConfig
from services.thinker.processor.duplex_layout import duplex_tool_outputs_note, duplex_tools_note
from services.thinker.sampling import choose_tokens

torch.set_num_threads(1)
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    },
}
SIGNATURE = json.dumps({"type": "function", "function": WEATHER}, ensure_ascii=False)


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def _call_unit(seq: int, *, forced: bool, spec: str | None = None) -> thinker_pb2.ThinkerRequest:
    req = unit(seq)
    u = req.unit
    u.request_response = True
    u.tools_json.append(SIGNATURE)
    u.tool_call.CopyFrom(
        thinker_pb2.Constraint(
            kind=thinker_pb2.Constraint.KIND_TOOL_CALLS, spec=spec or json.dumps([WEATHER])
        )
    )
    u.tool_call_forced = forced
    return req


def _call_policy(compiler: GrammarCompiler, tools: list[dict], *, forced: bool) -> DuplexPolicy:
    """A greedy duplex policy offering ``tools`` under the tool-call grammar (a forced call speaks)."""
    grammar = compiler.grammar(
        thinker_pb2.Constraint(kind=thinker_pb2.Constraint.KIND_TOOL_CALLS, spec=json.dumps(tools))
    )
    return DuplexPolicy(
        DuplexSampling(temperature=0.0),
        PolicyState(),
        torch.zeros(151748, dtype=torch.bool),
        force_listen=False,
        force_speak=forced,
        tool_call=ToolCallPlan(lambda: compiler.from_grammar(grammar, check=False), forced=forced),
    )


def _args(call: str) -> dict[str, object]:
    assert call.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), call
    assert call.endswith("}\n</tool_call>"), call
    body = json.loads(call[len("<tool_call>\n") : -len("\n</tool_call>")])
    return body["arguments"]


@pytest.mark.parametrize("sampled", [False, True])
def test_forced_call_is_the_whole_turn_and_follows_the_schema(backend, sampled: bool) -> None:  # noqa: ANN001
    """``required`` at the requesting unit: a schema-valid call, the turn ended, nothing spoken; greedy
    and with the session's sampling (seeded), on random weights."""
    opened = duplex_open()
    if sampled:
        opened.open.sampling.CopyFrom(thinker_pb2.SamplingParams(temperature=0.7, seed=3))
    got = asyncio.run(_session(backend, [opened, _call_unit(0, forced=True), unit(1), END]))
    assert not any(r.HasField("error") for r in got), got
    first, second = [r.unit for r in got if r.HasField("unit")]
    gen = list(first.token_ids)
    assert first.decision == thinker_pb2.UNIT_DECISION_SPEAK and gen[0] == SPEAK
    assert gen[1] == TOOL_CALL_ID and gen[-2:] == [TURN_EOS, LISTEN], gen
    assert len(gen) > 19 or TOOL_CALL_END_ID in gen  # a call may run past the unit's 19 tokens
    jsonschema.validate(_args(first.tool_call), WEATHER["parameters"])
    assert (
        first.turn_end and not first.tool_call_truncated and first.transcript == "" and not first.tool_error
    )
    # A turn that was only the call has nothing to voice: no speech chunk for it.
    assert not any(r.HasField("speech") and r.speech.id.unit_seq == 0 for r in got)
    # The next unit is decided by the model again (no call: the plan is per unit).
    assert not second.tool_call


def test_tools_and_results_enter_the_context_as_template_messages(backend) -> None:  # noqa: ANN001
    """The offered tools go in once (again only when they change), the client's results as the
    template's tool message, each right before its unit."""
    listen = dict(force_listen_units=3)
    offered = [unit(i) for i in range(3)]
    for req in offered:
        req.unit.tools_json.append(SIGNATURE)
    offered[2].unit.tool_outputs.extend(['{"temp": 21}', "sunny"])
    plain = asyncio.run(_session(backend, [duplex_open(**listen), *(unit(i) for i in range(3)), END]))
    noted = asyncio.run(_session(backend, [duplex_open(**listen), *offered, END]))
    ctx_plain = [r.unit.context_tokens for r in plain if r.HasField("unit")]
    ctx_noted = [r.unit.context_tokens for r in noted if r.HasField("unit")]
    encode = backend.processor.encode_text
    tools = len(encode(duplex_tools_note([SIGNATURE])))
    results = len(encode(duplex_tool_outputs_note(['{"temp": 21}', "sunny"])))
    assert [b - a for a, b in zip(ctx_plain, ctx_noted, strict=True)] == [tools, tools, tools + results]
    assert (
        duplex_tool_outputs_note(["x"])
        == "<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n"
    )
    assert duplex_tools_note([SIGNATURE]).startswith("<|im_start|>system\n# Tools\n")


def test_a_grammar_that_does_not_compile_is_reported_and_the_unit_goes_on(backend) -> None:  # noqa: ANN001
    got = asyncio.run(_session(backend, [duplex_open(), _call_unit(0, forced=True, spec="not json"), END]))
    assert not any(r.HasField("error") for r in got), got
    (result,) = [r.unit for r in got if r.HasField("unit")]
    assert "bad constraint" in result.tool_error and not result.tool_call
    assert result.decision == thinker_pb2.UNIT_DECISION_SPEAK  # decided as a plain requested unit


def test_auto_call_starts_when_the_model_draws_the_tag(backend) -> None:  # noqa: ANN001
    """``auto``: the policy decides as always; the ``<tool_call>`` it draws is completed under the
    grammar (random logits otherwise), then ``<|turn_eos|>`` and ``<|listen|>`` end turn and unit. The unit
    reserves the KV of a whole call; its token cap grows only once the call starts."""
    compiler = backend.grammar or GrammarCompiler(
        backend.processor.tokenizer, len(backend.processor.tokenizer)
    )
    policy = _call_policy(compiler, [WEATHER], forced=False)
    state = policy.state
    assert policy.reserve_tokens == CALL_UNIT_TOKENS and policy.max_new_tokens == 19
    gen = torch.Generator().manual_seed(0)
    tokens: list[int] = []
    for step in range(600):
        logits = torch.randn(1, 151748, generator=gen)
        if step == 0:
            logits[0, SPEAK] = 50.0
        elif step in (1, 2):
            logits[0, 1000 + step] = 50.0  # two spoken tokens before the call
        elif step == 3:
            logits[0, TOOL_CALL_ID] = 50.0
        (token,) = choose_tokens([policy], logits, [tokens], [len(tokens)])
        tokens.append(token)
        if policy.finish_reason(token, len(tokens)) is not None:
            break
    assert tokens[:4] == [SPEAK, 1001, 1002, TOOL_CALL_ID] and tokens[-2:] == [TURN_EOS, LISTEN], tokens
    assert policy.max_new_tokens > 19 and len(tokens) > 19
    start, end = call_bounds(tokens)  # type: ignore[misc]
    call = backend.processor.tokenizer.decode(tokens[start:end], skip_special_tokens=False)
    jsonschema.validate(_args(call), WEATHER["parameters"])
    assert select_span(tokens) == [1, 2] and state.turn_ended


def test_sliding_window_leaves_room_for_a_call(backend) -> None:  # noqa: ANN001
    """With ``--duplex-window basic`` a unit that may call counts the whole call's room when the window
    decides to trim, so a long session with tools trims instead of passing the context; after a trim the
    tools note goes in again, and a forced call still completes."""
    import dataclasses

    from services.thinker.duplex_window import DuplexWindow
    from services.thinker.engine import ThinkerEngine

    small = ThinkerEngine(
        backend.engine.runner.llm, EngineConfig(max_context=900, kv_budget_bytes=8 << 20), "cpu"
    )
    small.start()
    try:
        b = dataclasses.replace(
            backend, engine=small, duplex_window=DuplexWindow(high=850, low=700).validate(900)
        )
        offered = [unit(i) for i in range(24)]
        for req in offered:
            req.unit.tools_json.append(SIGNATURE)
            req.unit.tool_call.CopyFrom(
                thinker_pb2.Constraint(
                    kind=thinker_pb2.Constraint.KIND_TOOL_CALLS, spec=json.dumps([WEATHER])
                )
            )
        got = asyncio.run(
            _session(b, [duplex_open(force_listen_units=24), *offered, _call_unit(24, forced=True), END])
        )
        assert not [r.error.message for r in got if r.HasField("error")]
        units = [r.unit for r in got if r.HasField("unit")]
        assert len(units) == 25 and got[-1].done.usage.extra["window_trims"] >= 1
        assert all(u.context_tokens <= 850 for u in units[:-1])
        jsonschema.validate(_args(units[-1].tool_call), WEATHER["parameters"])
    finally:
        small.shutdown()


def test_a_call_past_its_token_cap_is_cut_and_ends_the_turn(backend) -> None:  # noqa: ANN001
    """A call whose grammar is still open after 512 tokens (a free string on random logits) ends the unit
    for length with the turn ended; its block has no ``</tool_call>``, which is how it is reported as cut."""
    from services.thinker.duplex_policy import MAX_TOOL_CALL_TOKENS

    free = {
        "name": "say",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    }
    compiler = backend.grammar
    policy = _call_policy(compiler, [free], forced=True)
    state = policy.state
    tokenizer = backend.processor.tokenizer
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    quotes = torch.tensor([i for i, p in enumerate(pieces) if p and '"' in p])
    gen = torch.Generator().manual_seed(1)
    tokens: list[int] = []
    reason = None
    while reason is None:
        logits = torch.randn(1, 151748, generator=gen)
        if len(tokens) > 4:
            logits[0, quotes] = -1e4  # inside the string no quote wins: it stays open
        (token,) = choose_tokens([policy], logits, [tokens], [len(tokens)])
        tokens.append(token)
        reason = policy.finish_reason(token, len(tokens))
    assert reason == "length" and len(tokens) == 1 + MAX_TOOL_CALL_TOKENS and state.turn_ended
    start, end = call_bounds(tokens)  # type: ignore[misc]
    assert (start, end) == (1, len(tokens)) and TOOL_CALL_END_ID not in tokens
