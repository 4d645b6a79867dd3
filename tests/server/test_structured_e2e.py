"""Structured outputs end to end, held by the grammar engine: the official `openai` client
against a real `specserve serve` on the default model, greedy. Each prompt is one the model
would NOT answer in the asked shape on its own, so these pass only once the engine enforces
`SamplingParams.structured_outputs` (tool_choice "required" and named functions, JSON
schemas, `client.chat.completions.parse` with pydantic models and strict tools,
vLLM's `structured_outputs`)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.real_serve import REAL_NAME, real_client
from tests.server.test_tools_e2e import READ_FILE, WEATHER

HELLO = [{"role": "user", "content": "Say hello to me in one short sentence."}]
GREEDY = {"model": REAL_NAME, "temperature": 0, "max_tokens": 96}


class Joke(BaseModel):  # bounded: greedy, a small model's punchline can run on forever
    setup: str = Field(max_length=80)
    punchline: str = Field(max_length=80)


class Lookup(BaseModel):
    city: str
    days: int


@pytest.fixture(scope="module")
def client(real_server):
    return real_client(real_server)


def test_tool_choice_required_makes_a_call_where_the_model_would_answer_in_text(client):
    out = client.chat.completions.create(messages=HELLO, tools=[WEATHER, READ_FILE],
                                         tool_choice="required", **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "read_file")
        key = "city" if call.function.name == "get_weather" else "path"
        assert set(arguments) >= {key} and isinstance(arguments[key], str)


def test_a_named_function_is_the_one_called_with_arguments_of_its_schema(client):
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    out = client.chat.completions.create(messages=ask, tools=[WEATHER, READ_FILE], **GREEDY,
                                         tool_choice={"type": "function",
                                                      "function": {"name": "read_file"}},
                                         parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "read_file"
    assert isinstance(json.loads(call.function.arguments)["path"], str)


def test_a_streamed_required_call_reassembles_to_valid_arguments(client):
    from tests.server.test_tools import accumulate

    # one call: with parallel calls allowed, the model calls get_weather for city after city
    chunks = client.chat.completions.create(messages=HELLO, tools=[WEATHER], stream=True,
                                            tool_choice="required", parallel_tool_calls=False,
                                            **GREEDY)
    content, calls, finish = accumulate(chunks)
    assert finish == "tool_calls" and calls and content is None
    assert all(name == "get_weather" and "city" in json.loads(args) for name, args in calls)


def test_a_json_schema_response_format_holds_the_answer_to_the_schema(client):
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a joke about compilers."}], **GREEDY,
        response_format={"type": "json_schema", "json_schema": {
            "name": "joke", "strict": True, "schema": Joke.model_json_schema()}})
    assert Joke.model_validate_json(out.choices[0].message.content)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    out = client.chat.completions.parse(
        messages=[{"role": "user", "content": "Tell me a joke about compilers."}],
        response_format=Joke, **GREEDY)
    joke = out.choices[0].message.parsed
    assert isinstance(joke, Joke) and joke.setup and joke.punchline


def test_parse_with_a_strict_pydantic_tool_returns_parsed_arguments(client):
    out = client.chat.completions.parse(
        messages=HELLO, tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
        **GREEDY)
    (call,) = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_json_object_and_vllm_structured_outputs_hold_the_output(client):
    out = client.chat.completions.create(messages=HELLO, response_format={"type": "json_object"},
                                         **GREEDY)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    text = client.completions.create(
        model=REAL_NAME, prompt="The best language is", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": [" Rust", " Python", " C"]}})
    assert text.choices[0].text in (" Rust", " Python", " C")
