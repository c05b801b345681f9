"""Every field of OpenAI's chat completions request is handled on purpose: served, accepted with a
documented harmless meaning, or refused with a 400 naming it, never dropped unseen.

The field list comes from the installed ``openai`` SDK (``CompletionCreateParams`` and the message,
stream-option and audio types it nests), so a field that a new SDK adds fails here until
``gateway/openai/request_models.py`` (``OPENAI_FIELDS``) and docs/api.md both say what becomes of it.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionAudioParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
    completion_create_params,
)

from gateway.openai.errors import APIError
from gateway.openai.protocol import parse_chat_request
from gateway.openai.request_models import (
    OPENAI_FIELDS,
    AssistantMessage,
    AudioOutput,
    ChatCompletionRequest,
    DeveloperMessage,
    StreamOptions,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

MODEL = "m"
BASE: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# For each field that is not plainly served: values that are accepted, then values that are refused
# (with the param the 400 must name).
ACCEPTED: dict[str, list[Any]] = {
    "n": [1, None],
    "store": [False, None],
    "service_tier": ["auto", "default"],
    "reasoning_effort": ["none"],
    "verbosity": ["medium"],
    "prompt_cache_retention": ["in_memory"],
    "prompt_cache_options": [{"mode": "implicit"}, {}],
    "user": ["user-1"],
    "safety_identifier": ["h" * 128],
    "prompt_cache_key": ["k"],
    "metadata": [{"a": "b"}, {f"k{i}": "v" * 512 for i in range(16)}],
    "prediction": [
        {"type": "content", "content": "x"},
        {"type": "content", "content": [{"type": "text", "text": "x"}]},
    ],
    "functions": [[], None],
    "function_call": [None],
    "web_search_options": [None],
    "moderation": [None],
}
REFUSED: dict[str, list[tuple[Any, str]]] = {
    "n": [(2, "n")],
    "store": [(True, "store")],
    "service_tier": [("flex", "service_tier"), ("priority", "service_tier")],
    "reasoning_effort": [("low", "reasoning_effort"), ("high", "reasoning_effort")],
    "verbosity": [("low", "verbosity"), ("high", "verbosity")],
    "prompt_cache_retention": [("24h", "prompt_cache_retention")],
    "prompt_cache_options": [
        ({"mode": "explicit"}, "prompt_cache_options.mode"),
        ({"ttl": "30m"}, "prompt_cache_options.ttl"),
    ],
    "user": [(7, "user")],
    "safety_identifier": [("h" * 129, "safety_identifier")],
    "prompt_cache_key": [(["k"], "prompt_cache_key")],
    "metadata": [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata." + "k" * 65),
        ({"a": "v" * 513}, "metadata.a"),
    ],
    "prediction": [({"type": "other", "content": "x"}, "prediction.type")],
    "functions": [([{"name": "f"}], "functions")],
    "function_call": [("auto", "function_call"), ({"name": "f"}, "function_call")],
    "web_search_options": [({}, "web_search_options")],
    "moderation": [({"model": "omni-moderation-latest"}, "moderation")],
}


def _sdk_fields(typed_dict: Any) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def _parse(body: dict[str, Any]) -> Any:
    return parse_chat_request(body, MODEL)


def _refusal(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        _parse(body)
    err = info.value
    assert err.status == 400 and err.err_type == "invalid_request_error", err.message
    return err


def test_every_sdk_field_has_a_status_and_a_declared_field() -> None:
    sdk = _sdk_fields(completion_create_params.CompletionCreateParamsBase)
    sdk |= _sdk_fields(completion_create_params.CompletionCreateParamsStreaming)
    assert sdk == set(OPENAI_FIELDS), (
        "a field the SDK sends that OPENAI_FIELDS does not decide (or a stale one)"
    )
    assert set(OPENAI_FIELDS.values()) <= {"yes", "ignored", "partly", "400"}
    declared = set(ChatCompletionRequest.model_fields)
    assert set(OPENAI_FIELDS) <= declared


def test_nested_sdk_fields_are_declared() -> None:
    """Message, stream-option and audio fields: each one is declared (served, ignored or refused there)."""
    pairs = [
        (ChatCompletionSystemMessageParam, SystemMessage),
        (ChatCompletionDeveloperMessageParam, DeveloperMessage),
        (ChatCompletionUserMessageParam, UserMessage),
        (ChatCompletionAssistantMessageParam, AssistantMessage),
        (ChatCompletionToolMessageParam, ToolMessage),
        (ChatCompletionStreamOptionsParam, StreamOptions),
        (ChatCompletionAudioParam, AudioOutput),
    ]
    for sdk_type, model in pairs:
        missing = _sdk_fields(sdk_type) - set(model.model_fields)
        assert not missing, f"{model.__name__} does not declare {missing}"


def test_non_plain_fields_accept_and_refuse_as_documented() -> None:
    assert set(ACCEPTED) == set(REFUSED) == {f for f, s in OPENAI_FIELDS.items() if s != "yes"}
    plain = _parse(BASE)
    for field, values in ACCEPTED.items():
        for value in values:
            got = _parse({**BASE, field: value})
            if OPENAI_FIELDS[field] in ("ignored", "partly", "400"):
                assert got == plain, (field, value)  # no effect at all on what reaches the stages
    for field, cases in REFUSED.items():
        for value, param in cases:
            err = _refusal({**BASE, field: value})
            assert err.param == param, (field, value, err.param, err.message)
            if OPENAI_FIELDS[field] == "400":
                assert err.code == "unsupported_parameter", (field, err.code)


def test_unknown_keys_are_refused_by_name() -> None:
    for key in ("foo", "guided_json", "min_p", "x" * 200):
        err = _refusal({**BASE, key: 1})
        assert err.code == "unknown_parameter" and err.param is not None and key.startswith(err.param[:77])
    # Unknown keys inside objects stay ignored: what the SDK's own response objects carry back.
    echoed = {
        **BASE,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {}}]},
            {"role": "assistant", "content": "yes", "refusal": None, "annotations": [], "audio": {"id": "a"}},
            {"role": "user", "content": "more"},
        ],
    }
    assert [m.role for m in _parse(echoed).messages] == ["user", "assistant", "user"]


def test_message_level_refusals_name_the_field() -> None:
    legacy = {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}
    err = _refusal({**BASE, "messages": [*BASE["messages"], legacy]})
    assert (err.param, err.code) == ("messages[1].function_call", "unsupported_parameter")
    err = _refusal({**BASE, "messages": [*BASE["messages"], {"role": "assistant", "audio": {"id": "a"}}]})
    assert err.param == "messages[1].audio"
    err = _refusal({**BASE, "stream_options": {"include_obfuscation": True}})
    assert err.param == "stream_options.include_obfuscation"
    err = _refusal({**BASE, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert err.param == "reasoning_effort"
    voice = _parse({**BASE, "audio": {"voice": {"id": "alloy"}, "format": "wav"}})
    assert voice.openai_audio is not None and voice.openai_audio.voice == "alloy"


def test_logit_bias_is_checked_and_passed_on() -> None:
    assert _parse({**BASE, "logit_bias": {"12": 100, "7": -5.5}}).logit_bias == {12: 100.0, 7: -5.5}
    for value, param in (
        ({"x": 1}, "logit_bias.x"),
        ({"-1": 1}, "logit_bias.-1"),
        ({"1": 101}, "logit_bias.1"),
        ({"1": "1"}, "logit_bias.1"),
        ({str(i): 1 for i in range(301)}, "logit_bias"),
        ([1], "logit_bias"),
    ):
        assert _refusal({**BASE, "logit_bias": value}).param == param, value


def _doc_rows() -> dict[str, str]:
    """docs/api.md's chat table: each plainly named field (no ``.`` or ``[]``) -> its status."""
    text = DOCS.read_text()
    section = text[text.index("## `POST /v1/chat/completions`") : text.index("### Audio output")]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if re.fullmatch(r"[a-z_]+", name):
                assert name not in rows, f"{name} has two rows"
                rows[name] = cells[1]
    return rows


def test_docs_table_lists_every_field_with_the_code_status() -> None:
    rows = _doc_rows()
    for field, status in OPENAI_FIELDS.items():
        assert rows.get(field) == status, (field, rows.get(field), status)
    extensions = set(ChatCompletionRequest.model_fields) - set(OPENAI_FIELDS)
    assert {f for f, s in rows.items() if s == "ext"} == extensions
    assert set(rows) == set(ChatCompletionRequest.model_fields)
