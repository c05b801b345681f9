"""The frameworks people build on OpenAI's API, unmodified, against the gateway over a real thinker stage
(tiny checkpoint, CPU): LangChain's ``ChatOpenAI`` (``bind_tools``, ``with_structured_output`` in both of
its methods), instructor (tool mode and JSON-schema mode), the OpenAI Agents SDK (an ``Agent`` with a
``@function_tool`` run by ``Runner.run`` through ``OpenAIChatCompletionsModel``) and pydantic-ai (an
``Agent`` with a pydantic ``output_type``, as a tool and as native structured output).

The weights are random, so only constrained output is predictable: every request here forces a tool call
or a JSON schema, and the schemas hold enums, booleans and bounded integers only (a free string could run
to the token budget). What the frameworks return must then be real, validated objects. One thinker serves
the whole module; the answers are text only, so the talker and code2wav are never contacted (their
addresses are dead ones).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from gateway_server import ThreadedGateway
from pydantic import BaseModel, Field
from stage_processes import dead_address, start_stages, stop_all

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
# The default token budget for frameworks that send none: room for a forced call or a small JSON object.
OVERRIDES = {"thinker": {"sampling": {"max_tokens": 96}}}


class Forecast(BaseModel):
    """A weather forecast."""

    unit: Literal["c", "f"]
    rain: bool
    days: int = Field(ge=1, le=7)


class GetWeather(BaseModel):
    """Weather of the user's city for the next days."""

    unit: Literal["c", "f"] = Field(description="temperature unit")
    days: int = Field(ge=1, le=7, description="how many days")


@pytest.fixture(scope="module")
def base_url(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    procs = start_stages(
        tiny_ckpt, tmp_path_factory.mktemp("frameworks_logs"), [("thinker", ["--max-context", "2048"])]
    )
    addrs = {"thinker": procs[0].addr, "talker": dead_address(), "code2wav": dead_address()}
    config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu").with_overrides(OVERRIDES))
    try:
        with ThreadedGateway(config) as gw:
            yield f"{gw.url}/v1"
    finally:
        stop_all(procs)


def _check_forecast(value: object) -> Forecast:
    assert isinstance(value, Forecast), value
    Forecast.model_validate(value.model_dump())
    return value


# ------------------------------------------------------------------------------------------- LangChain


def test_langchain_bind_tools_returns_parsed_tool_calls(base_url: str) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="none", max_retries=0, timeout=300, max_tokens=96
    )
    # One call each: with parallel calls allowed a random model may go on calling until the budget ends.
    for tool_choice in ("required", "GetWeather"):
        bound = llm.bind_tools([GetWeather], tool_choice=tool_choice, strict=True, parallel_tool_calls=False)
        msg = bound.invoke("Weather in Paris?")
        assert isinstance(msg, AIMessage)
        assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls, msg
        (call,) = msg.tool_calls
        assert call["name"] == "GetWeather" and call["id"] and call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])
        assert msg.response_metadata["finish_reason"] == "tool_calls"
    # Streamed: LangChain assembles the call from delta.tool_calls fragments (id and name first).
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True, parallel_tool_calls=False)
    chunks = list(bound.stream("Weather in Paris?"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert len(chunks) > 2 and len(whole.tool_calls) == 1 and not whole.invalid_tool_calls, whole
    GetWeather.model_validate(whole.tool_calls[0]["args"])


def test_langchain_with_structured_output_returns_an_instance(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="none", max_retries=0, timeout=300, max_tokens=96
    )
    for method in ("json_schema", "function_calling"):
        _check_forecast(llm.with_structured_output(Forecast, method=method).invoke("Forecast for Paris?"))
    # include_raw: the parsed object beside the AIMessage it came from, no parsing error.
    out = llm.with_structured_output(Forecast, include_raw=True).invoke("Forecast?")
    assert out["parsing_error"] is None and _check_forecast(out["parsed"])
    assert json.loads(out["raw"].content) == out["parsed"].model_dump()


# ------------------------------------------------------------------------------------------ instructor


def test_instructor_returns_a_validated_instance(base_url: str) -> None:
    import instructor

    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=300, max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        forecast = patched.chat.completions.create(
            model=MODEL,
            response_model=Forecast,
            messages=[{"role": "user", "content": "Forecast for Paris?"}],
            max_tokens=96,
            max_retries=0,
        )
        _check_forecast(forecast)


# ------------------------------------------------------------------------------- OpenAI Agents SDK


def test_agents_sdk_calls_the_function_tool_then_finishes(base_url: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @function_tool
    def get_weather(unit: Literal["c", "f"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather of the user's city.

        Args:
            unit: temperature unit.
            days: how many days.
        """
        calls.append({"unit": unit, "days": days})
        return json.dumps({"forecast": "sunny", "days": days})

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=300, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # The first turn must call the tool; the SDK then resets tool_choice so the agent can answer.
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96),
    )
    config = RunConfig(tracing_disabled=True)

    async def both() -> tuple[Any, list[str], object]:
        """A run, then the same run streamed (delta.tool_calls, then the answer's text): one event loop,
        as the async client's connections belong to the loop that opened them."""
        result = await Runner.run(agent, "Weather in Paris?", max_turns=4, run_config=config)
        run = Runner.run_streamed(agent, "Weather?", max_turns=4, run_config=config)
        names = [e.item.type async for e in run.stream_events() if e.type == "run_item_stream_event"]
        return result, names, run.final_output

    result, names, final = asyncio.run(both())
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
    assert names[:2] == ["tool_call_item", "tool_call_output_item"] and isinstance(final, str), names
    assert len(calls) >= 2
    for call in calls:
        jsonschema.validate(call, get_weather.params_json_schema)


# ------------------------------------------------------------------------------------------ pydantic-ai


def test_pydantic_ai_structured_output(base_url: str) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="none"))
    settings: Any = {"max_tokens": 96}
    for output_type in (Forecast, NativeOutput(Forecast)):
        agent = Agent(model, output_type=output_type, model_settings=settings, retries=0)
        result = agent.run_sync("Forecast for Paris?")
        _check_forecast(result.output)
