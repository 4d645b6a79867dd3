"""Tool calls end to end: the official `openai` client against a real `specserve serve` on the
default model (Qwen2.5-Coder 1.5B), greedy: the model's own call comes back parsed into
`message.tool_calls` with finish_reason "tool_calls", streamed as `delta.tool_calls` that
reassemble to the same call, and a conversation goes on after the tool's result. No grammar
is needed here: the model calls on its own."""

from __future__ import annotations

import json

import pytest

from tests.server.real_serve import REAL_NAME, real_client
from tests.server.test_tools import accumulate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CALL = {"model": REAL_NAME, "tools": [WEATHER, READ_FILE], "tool_choice": "auto",
        "temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def client(real_server):
    return real_client(real_server)


def test_the_model_calls_a_tool_and_the_call_comes_back_parsed(client):
    out = client.chat.completions.create(messages=ASK, **CALL)
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29


def test_the_same_call_streamed_reassembles_to_the_parsed_one(client):
    whole = client.chat.completions.create(messages=ASK, **CALL).choices[0].message
    chunks = list(client.chat.completions.create(messages=ASK, stream=True, **CALL))
    content, calls, finish = accumulate(chunks)
    assert finish == "tool_calls" and content is None
    assert calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    firsts = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or ()
              if c.id is not None]
    assert len(firsts) == 1 and firsts[0].function.name == "get_weather"
    assert firsts[0].function.arguments == "" and firsts[0].id.startswith("call_")


def test_a_conversation_goes_on_after_the_tools_result(client):
    first = client.chat.completions.create(messages=ASK, **CALL).choices[0].message
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id,
              "content": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})}
    # the follow-up without the tools: offered them again, the file's model (greedy, in its
    # float32 dequantization as in int4) calls get_weather once more instead of answering
    follow = {k: v for k, v in CALL.items() if k not in ("tools", "tool_choice")}
    out = client.chat.completions.create(messages=[*ASK, first, result], **{
        **follow, "max_tokens": 40})
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert "21" in choice.message.content
