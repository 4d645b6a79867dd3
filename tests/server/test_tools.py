"""Tools through a real `specserve serve` process on a tiny random model (whose template has no
tool syntax: the generic form): requests with tools, calls and results are served, streamed
chunks reassemble to the whole answer, and every bad tool input is a 400 naming its field
while the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import KEY, NAME
from tests.server.tool_calls.requests import ANSWERED, ASKED, CALLED, WEATHER_TOOL

GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def accumulate(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_conversation_with_tools_calls_and_results_is_served_streamed_as_whole(client):
    kw = {"model": NAME, "messages": [ASKED, CALLED, ANSWERED], "tools": [WEATHER_TOOL], **GREEDY}
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    content, calls, finish = accumulate(client.chat.completions.create(stream=True, **kw))
    assert (content or "") == (message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    assert finish == whole.choices[0].finish_reason
    assert whole.usage.prompt_tokens > 100  # the tools' description is in the prompt


def test_structured_fields_are_taken_on_both_endpoints(client):
    out = client.chat.completions.create(model=NAME, messages=[ASKED], **GREEDY,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=NAME, prompt="x", max_tokens=4,
                                     extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert text.choices[0].finish_reason in ("stop", "length")


def _post(server, body: dict) -> httpx.Response:
    with server.client() as http:
        return http.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, **body})


TOOLS = {"tools": [WEATHER_TOOL]}
BAD = [
    ("result of no call", {"messages": [ASKED, {**ANSWERED, "tool_call_id": "call_9"}], **TOOLS},
     "messages", "call_9"),
    ("result before its call", {"messages": [ASKED, ANSWERED, CALLED]}, "messages", "call_1"),
    ("tool message without its id", {"messages": [ASKED, {"role": "tool", "content": "x"}]},
     "messages", "tool_call_id"),
    ("calls on a user message", {"messages": [{**ASKED, "tool_calls": CALLED["tool_calls"]}]},
     "messages", "tool_calls"),
    ("unknown function named", {"messages": [ASKED], **TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice", "get_time"),
    ("required without tools", {"messages": [ASKED], "tool_choice": "required"}, "tool_choice",
     "no tools"),
    ("named without tools", {"messages": [ASKED], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "no tools"),
    ("empty tools", {"messages": [ASKED], "tools": []}, "tools", ""),
    ("a tool twice", {"messages": [ASKED], "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools",
     "twice"),
    ("a bad tool name", {"messages": [ASKED], "tools": [{"type": "function", "function": {
        "name": "get weather!"}}]}, "tools", ""),
    ("unknown tool_choice", {"messages": [ASKED], **TOOLS, "tool_choice": "always"},
     "tool_choice", ""),
    ("unknown response format", {"messages": [ASKED], "response_format": {"type": "yaml"}},
     "response_format", ""),
    ("two constraints", {"messages": [ASKED], "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a+"}}, "structured_outputs", "give one"),
    ("two kinds in one", {"messages": [ASKED], "structured_outputs": {"regex": "a", "choice": [
        "b"]}}, "structured_outputs", "exactly one"),
    ("null user content", {"messages": [{"role": "user", "content": None}]}, "messages", ""),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_tool_input_is_a_400_naming_its_field_and_the_server_keeps_serving(server, case):
    _, body, param, words = case
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert _post(server, {"messages": [ASKED], **TOOLS}).status_code == 200


def test_the_openapi_schema_documents_the_agent_fields(server):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()["components"]["schemas"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format",
            "structured_outputs"} <= set(schema["ChatCompletionRequest"]["properties"])
    assert "tool_calls" in schema["ChatResponseMessage"]["properties"]
    assert json.dumps(schema["ChatMessage"]).count("tool_call_id") >= 1


PICK = {"type": "function", "function": {
    "name": "pick", "description": "Pick a color", "strict": True,
    "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
                   "required": ["color"], "additionalProperties": False}}}
SIZE = {"type": "function", "function": {
    "name": "size", "description": "Pick a size", "strict": True,
    "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                   "required": ["n"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "size"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_on_the_tiny_model_comes_back_parsed_whole_and_streamed(client, choice):
    """The tiny random model never calls a tool on its own; `tool_choice` required or named
    holds its output to a call (the grammar), which the server parses back into `tool_calls`
    with finish_reason "tool_calls", streamed as `delta.tool_calls` that reassemble to it."""
    kw = {"model": NAME, "messages": [ASKED], "tools": [PICK, SIZE], "tool_choice": choice,
          "parallel_tool_calls": False, "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**kw).choices[0]
    (call,) = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, list(arguments)) in (("pick", ["color"]), ("size", ["n"]))
    assert arguments in ({"color": "red"}, {"color": "blue"}, {"n": 1}, {"n": 2}, {"n": 3})
    if choice != "required":
        assert call.function.name == "size"
    content, calls, finish = accumulate(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and not content
    assert calls == [(call.function.name, call.function.arguments)]
