"""Thinker stage (tiny checkpoint, CPU, over gRPC): grammar-constrained JSON and tool calls, stop strings
cut across token boundaries, logprobs on every TextDelta, penalties, tools rendered as the checkpoint's
chat template renders them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import jinja2
import jsonschema
import pytest
import torch

from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.thinker.backend import build_backend
from services.thinker.constrained import closed_objects, tool_call_lark
from services.thinker.engine import EngineConfig
from services.thinker.processor.chat import Message, ToolCall, render_chat
from services.thinker.sampling import Sampler, SamplingConfig, StopText
from services.thinker.server import make_server

torch.set_num_threads(1)
Kind = thinker_pb2.Constraint.Kind
SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["unit", "ok", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
    {"name": "noop", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(max_context=800, kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def _open(
    sampling: thinker_pb2.SamplingParams, text: str = "Answer.", **kw: object
) -> thinker_pb2.ThinkerOpen:
    msg = thinker_pb2.ChatMessage(role="user", content=[thinker_pb2.ContentPart(text=text)])
    ident = common_pb2.Identity(request_id="req-c", session_id="s-c", epoch=1, turn_id=1)
    return thinker_pb2.ThinkerOpen(
        id=ident, mode=common_pb2.STREAM_MODE_TURN, messages=[msg], sampling=sampling
    )


def _run(backend, *opens: thinker_pb2.ThinkerOpen) -> list[list[thinker_pb2.ThinkerResponse]]:  # noqa: ANN001
    """Runs the streams concurrently (one batch) and returns each one's responses."""

    async def main() -> list[list[thinker_pb2.ThinkerResponse]]:
        server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = thinker_pb2_grpc.ThinkerServiceStub(ch)

                async def one(o: thinker_pb2.ThinkerOpen) -> list[thinker_pb2.ThinkerResponse]:
                    async def gen() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
                        yield thinker_pb2.ThinkerRequest(open=o)

                    return [r async for r in stub.Generate(gen(), timeout=120)]

                return list(await asyncio.gather(*(one(o) for o in opens)))
        finally:
            await server.stop(grace=0.5)

    return asyncio.run(main())


def _text(responses: list[thinker_pb2.ThinkerResponse]) -> str:
    return "".join(r.text.text for r in responses if r.WhichOneof("kind") == "text")


def _done(responses: list[thinker_pb2.ThinkerResponse]) -> common_pb2.Done:
    assert responses[-1].WhichOneof("kind") == "done", responses[-1]
    return responses[-1].done


def test_json_schema_and_tool_calls_are_enforced_next_to_a_free_row(backend) -> None:  # noqa: ANN001
    schema = thinker_pb2.SamplingParams(
        max_tokens=60,
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_JSON_SCHEMA, spec=json.dumps(SCHEMA)),
    )
    sampled = thinker_pb2.SamplingParams(
        max_tokens=60,
        temperature=1.0,
        seed=7,
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_JSON_OBJECT),
    )
    tools = thinker_pb2.SamplingParams(
        max_tokens=80,
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_TOOL_CALLS, spec=json.dumps(TOOLS[:1])),
    )
    free = thinker_pb2.SamplingParams(max_tokens=12)
    out = _run(backend, _open(schema), _open(sampled), _open(tools), _open(free))
    value = json.loads(_text(out[0]))
    jsonschema.validate(value, SCHEMA)
    assert _text(out[0]) == json.dumps(value, separators=(",", ":"))  # compact: no free whitespace
    assert _done(out[0]).finish_reason == "stop"
    # json_object under sampling: a JSON object ends it, or max_tokens cuts it (random weights).
    if _done(out[1]).finish_reason == "stop":
        assert isinstance(json.loads(_text(out[1])), dict)
    else:
        assert _text(out[1]).startswith("{")
    call = _text(out[2])
    assert call.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), call
    assert call.endswith("}\n</tool_call>")
    body = json.loads(call[len("<tool_call>\n") : -len("\n</tool_call>")])
    jsonschema.validate(body["arguments"], TOOLS[0]["parameters"])
    assert _done(out[2]).finish_reason == "stop"
    assert _done(out[3]).usage.completion_tokens == 12  # the unconstrained row was not held back


def test_open_objects_get_only_their_declared_keys(backend) -> None:  # noqa: ANN001
    """A schema that leaves other keys open (no additionalProperties, as instructor and LangChain send
    tool parameters): the greedy random model used to invent keys until max_tokens; now the object ends
    with its declared keys and still validates against the open schema."""
    open_schema = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}
    params = thinker_pb2.SamplingParams(
        max_tokens=60,
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_JSON_SCHEMA, spec=json.dumps(open_schema)),
    )
    open_tool = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": SCHEMA["properties"]}}
    ]
    tools = thinker_pb2.SamplingParams(
        max_tokens=80,
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_TOOL_CALLS, spec=json.dumps(open_tool)),
    )
    out_schema, out_tool = _run(backend, _open(params), _open(tools))
    value = json.loads(_text(out_schema))
    jsonschema.validate(value, open_schema)
    assert set(value) == set(SCHEMA["properties"]) and _done(out_schema).finish_reason == "stop"
    call = json.loads(_text(out_tool)[len("<tool_call>\n") : -len("\n</tool_call>")])
    assert set(call["arguments"]) <= set(SCHEMA["properties"]) and _done(out_tool).finish_reason == "stop"


def test_closed_objects_closes_only_what_stays_satisfiable() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    closed = {**point, "additionalProperties": False}
    assert closed_objects(point) == closed
    nested = {
        "type": "object",
        "properties": {"p": point, "ps": {"type": "array", "items": point}},
        "$defs": {"P": point},
        "anyOf": [point],
    }
    got = closed_objects(nested)
    assert got["properties"]["p"] == closed and got["properties"]["ps"]["items"] == closed
    assert got["$defs"]["P"] == closed and got["anyOf"] == [closed]
    assert "additionalProperties" not in got  # anyOf beside properties may add keys: left open
    # Left as they are: explicit additionalProperties, allOf members, a required key not declared,
    # minProperties over the declared count, a schema without properties, a property named "properties".
    for schema in (
        {**point, "additionalProperties": True},
        {**point, "additionalProperties": {"type": "string"}},
        {**point, "required": ["y"]},
        {**point, "minProperties": 2},
        {"type": "object"},
    ):
        assert closed_objects(schema) == schema
    all_of = {"allOf": [point, {"type": "object", "properties": {"y": {"type": "integer"}}}]}
    assert closed_objects(all_of) == all_of
    named = {"type": "object", "properties": {"properties": point}}
    assert closed_objects(named) == {
        **named,
        "properties": {"properties": closed},
        "additionalProperties": False,
    }
    assert closed_objects(point) is not point and "additionalProperties" not in point  # a copy


def test_bad_schema_is_a_typed_error(backend) -> None:  # noqa: ANN001
    bad = thinker_pb2.SamplingParams(
        constraint=thinker_pb2.Constraint(kind=Kind.KIND_JSON_SCHEMA, spec="{not json")
    )
    (out,) = _run(backend, _open(bad))
    assert out[-1].WhichOneof("kind") == "error"
    assert out[-1].error.param == "sampling.constraint"


def test_stop_strings_cut_the_text_and_end_generation(backend) -> None:  # noqa: ANN001
    (ref,) = _run(backend, _open(thinker_pb2.SamplingParams(max_tokens=40)))
    text = _text(ref)
    assert len(text) > 12
    # A stop that spans token boundaries: a slice from the middle of the greedy text.
    stop = text[5:11]
    (out,) = _run(backend, _open(thinker_pb2.SamplingParams(max_tokens=40, stop=[stop, "never-seen"])))
    assert _text(out) == text[: text.index(stop)]
    assert _done(out).finish_reason == "stop"
    assert _done(out).usage.completion_tokens < 40


def test_stop_text_holds_back_partial_matches() -> None:
    st = StopText(["abc", "xy"])
    assert st.feed("12a") == "12"
    assert st.feed("b") == ""
    assert st.feed("d") == "abd"
    assert st.feed("x") == ""
    assert st.feed("q") == "xq"
    assert st.feed("zab") == "z"
    assert st.feed("c tail") == "" and st.matched == "abc"
    assert st.flush() == ""


def test_logprobs_on_every_delta_and_penalties(backend) -> None:  # noqa: ANN001
    lp = thinker_pb2.SamplingParams(max_tokens=8, logprobs=True, top_logprobs=3)
    pen = thinker_pb2.SamplingParams(max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0)
    plain = thinker_pb2.SamplingParams(max_tokens=30)
    out_lp, out_pen, out_plain = _run(backend, _open(lp), _open(pen), _open(plain))
    deltas = [r.text for r in out_lp if r.WhichOneof("kind") == "text" and r.text.token_ids]
    assert len(deltas) == 8
    for d in deltas:
        (entry,) = d.logprobs
        assert entry.token_id == d.token_ids[0] and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: the best is the chosen
        assert entry.top_logprobs[0].token_id == entry.token_id
        assert entry.token_bytes.decode("utf-8", errors="replace") == entry.token
    assert _done(out_pen).usage.completion_tokens == 30 == _done(out_plain).usage.completion_tokens
    # The penalty itself: logit -= frequency * count + presence * [count > 0], generated tokens only.
    cfg = SamplingConfig(frequency_penalty=0.5, presence_penalty=1.0).validate()
    got = Sampler(cfg).process(torch.zeros(6), [5, 5, 1, 2, 2, 2], 4)  # generated: 1 once, 2 three times
    assert got.tolist() == [0.0, -1.5, -2.5, 0.0, 0.0, 0.0]


def test_logit_bias_forces_and_bans_tokens(backend) -> None:  # noqa: ANN001
    """+100 on one id makes greedy decoding choose it at every step, -100 on the greedy first token bans
    it, also next to a plain row in the same batch; an id beyond the vocabulary is a typed error."""
    forced_id = 9707
    forced = thinker_pb2.SamplingParams(max_tokens=6, logit_bias={forced_id: 100.0})
    plain = thinker_pb2.SamplingParams(max_tokens=6)
    out_forced, out_plain = _run(backend, _open(forced), _open(plain))
    ids = [t for r in out_forced if r.WhichOneof("kind") == "text" for t in r.text.token_ids]
    assert ids == [forced_id] * 6
    greedy = [t for r in out_plain if r.WhichOneof("kind") == "text" for t in r.text.token_ids]
    assert len(greedy) == 6 and greedy != ids
    banned = thinker_pb2.SamplingParams(max_tokens=1, logit_bias={greedy[0]: -100.0})
    (out_banned,) = _run(backend, _open(banned))
    (first,) = [t for r in out_banned if r.WhichOneof("kind") == "text" for t in r.text.token_ids]
    assert first != greedy[0]
    (bad,) = _run(backend, _open(thinker_pb2.SamplingParams(logit_bias={10_000_000: 1.0})))
    assert bad[-1].WhichOneof("kind") == "error" and bad[-1].error.param == "logit_bias.10000000"
    # The bias itself: added before the penalties; a masked (-inf) entry stays masked.
    cfg = SamplingConfig(logit_bias=((1, 2.5), (3, -100.0)), frequency_penalty=1.0).validate()
    got = Sampler(cfg).process(torch.tensor([0.0, 0.0, float("-inf"), 1.0]), [1], 1)
    assert got.tolist() == [0.0, 1.5, float("-inf"), -99.0]
    assert not Sampler(cfg).batchable_greedy


def test_tools_render_as_the_checkpoint_template(tiny_ckpt: Path) -> None:
    template = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.Environment()
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit":"c"}'}}
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "warm"},
    ]
    ref = env.from_string(template).render(
        messages=msgs, tools=tools, add_generation_prompt=True, enable_thinking=False
    )
    mine = render_chat(
        [
            Message(
                m["role"],
                [m["content"]],
                [
                    ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"])
                    for c in m.get("tool_calls", [])
                ],
            )
            for m in msgs
        ],
        tools=[json.dumps(t, ensure_ascii=False) for t in tools],
    )
    assert mine == ref


def test_parallel_tool_grammar_allows_several_calls() -> None:
    assert tool_call_lark(TOOLS, parallel=True).startswith('start: call ("\\n" call)*')
    assert tool_call_lark(TOOLS, parallel=False).startswith("start: call\n")
