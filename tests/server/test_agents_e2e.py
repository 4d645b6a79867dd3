"""The agents' wires end to end on the default model (Qwen2.5-Coder 1.5B), greedy: the official
`openai` client's `responses.create` (streamed and not, a function tool, a
`function_call_output` turn), the official `anthropic` client's `messages.create` and
`messages.stream` (tools, a `tool_result` turn, `count_tokens`), and the OpenAI Agents SDK with
its default model (the Responses API) running a two-turn tool loop. The model calls on its own
(tool_choice auto): the grammar holds its call to the declared tool."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.server.conftest import KEY
from tests.server.real_serve import REAL_NAME, real_client

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city", "parameters": SCHEMA}
READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file of the project",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                            "required": ["path"]}}
ASK = "What is the weather in Paris right now?"
RESULT = json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})


@pytest.fixture(scope="module")
def oai(real_server):
    return real_client(real_server)


@pytest.fixture(scope="module")
def claude(real_server):
    return anthropic.Anthropic(base_url=real_server.base_url, api_key=KEY, max_retries=0,
                               timeout=600)


def test_responses_the_model_calls_a_tool_streamed_as_whole_and_answers_from_its_output(oai):
    kw = {"model": REAL_NAME, "input": ASK, "tools": [WEATHER, READ_FILE], "temperature": 0,
          "max_output_tokens": 48}
    whole = oai.responses.create(**kw)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(oai.responses.create(stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    # the follow-up without the tools: offered them again (even with tool_choice "none"), the
    # file's own model (greedy) calls get_weather once more instead of answering
    follow = {k: v for k, v in kw.items() if k != "tools"}
    after = oai.responses.create(**{**follow, "input": [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]})
    assert not [i for i in after.output if i.type == "function_call"]
    assert "21" in after.output_text


def test_messages_the_model_uses_a_tool_streamed_as_whole_and_answers_from_its_result(claude):
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
             for t in (WEATHER, READ_FILE)]
    kw = {"model": REAL_NAME, "max_tokens": 48, "tools": tools,
          "messages": [{"role": "user", "content": ASK}], "extra_body": {"temperature": 0}}
    whole = claude.messages.create(**kw)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content]
    follow = {k: v for k, v in kw.items() if k != "tools"}  # as in the Responses test
    after = claude.messages.create(**{**follow, "messages": [
        {"role": "user", "content": ASK}, {"role": "assistant", "content": whole.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": RESULT}]}]})
    assert after.stop_reason in ("end_turn", "max_tokens")
    assert "21" in "".join(b.text for b in after.content if b.type == "text")
    counted = claude.messages.count_tokens(model=REAL_NAME, tools=tools,
                                           messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_openai_agents_sdk_runs_a_two_turn_tool_loop_on_its_default_model(real_server):
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=f"{real_server.base_url}/v1", api_key=KEY,
                                          max_retries=0, timeout=600), use_for_tracing=False)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return RESULT

    agent = Agent(name="weather", instructions="You are a weather assistant. Look the weather "
                  "up with get_weather, then tell the user what it is.",
                  tools=[get_weather], model=REAL_NAME,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    result = Runner.run_sync(agent, ASK, max_turns=4)
    assert asked == ["Paris"]
    assert "21" in result.final_output
