"""The agents' wires through a real `specserve serve` process on a tiny random model: the
official `openai` client's `responses` and the official `anthropic` client's `messages`
(create, stream, count_tokens) get a tool call the grammar forces (`required`, a named tool;
a schema of enums, so a random model finishes its call) over every endpoint, a conversation
goes on after the tool's result, streams reassemble to the whole answer, and bad input gets
the endpoint's own error shape, never a 500."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import KEY, NAME

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
          "required": ["city"]}
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather now",
            "parameters": PARAMS}
TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": PARAMS}
ASK = "What is the weather in Paris?"
LONG = 200  # tokens: a call of the tiny model's characters fits


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_chat_completions_with_a_forced_call_over_http(oai):
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ASK}],
                                          tools=[chat_tool], tool_choice=choice,
                                          max_tokens=LONG, temperature=0)
        (call,) = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")


def test_responses_give_a_forced_call_streamed_as_whole_and_go_on_after_its_output(oai):
    kw = {"model": NAME, "input": ASK, "tools": [FUNCTION], "max_output_tokens": LONG,
          "temperature": 0}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        whole = oai.responses.create(tool_choice=choice, **kw)
        (call,) = calls_of(whole)
        assert whole.status == "completed" and call.name == "get_weather"
        assert json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
        assert call.call_id.startswith("call_") and whole.usage.input_tokens > 0
        assert whole.model_extra["speculative_stats"]["enabled"] is True
        events = list(oai.responses.create(tool_choice=choice, stream=True, **kw))
        done = events[-1]
        assert done.type == "response.completed"
        assert [(c.name, c.arguments) for c in calls_of(done.response)] == [
            (call.name, call.arguments)]
        assert [e.sequence_number for e in events] == list(range(len(events)))
    turn = [{"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    after = oai.responses.create(model=NAME, input=turn, tools=[FUNCTION], max_output_tokens=8,
                                 temperature=0)
    assert after.status in ("completed", "incomplete") and after.output


def test_messages_give_a_forced_tool_use_streamed_as_whole_and_go_on_after_its_result(claude):
    kw = {"model": NAME, "max_tokens": LONG, "tools": [TOOL],
          "messages": [{"role": "user", "content": ASK}], "extra_body": {"temperature": 0}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        whole = claude.messages.create(tool_choice=choice, **kw)
        (use,) = [b for b in whole.content if b.type == "tool_use"]
        assert whole.stop_reason == "tool_use" and use.name == "get_weather"
        assert use.input["city"] in ("Paris", "Tokyo") and use.id.startswith("toolu_")
        with claude.messages.stream(tool_choice=choice, **kw) as stream:
            streamed = stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [
            (b.type, getattr(b, "input", None)) for b in whole.content]
        assert streamed.stop_reason == "tool_use"
    after = claude.messages.create(model=NAME, max_tokens=8, tools=[TOOL], messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny, 21 C"}]}], system="Be brief.")
    assert after.stop_reason in ("end_turn", "max_tokens") and after.content
    counted = claude.messages.count_tokens(model=NAME, tools=[TOOL],
                                           messages=[{"role": "user", "content": ASK}])
    usage = whole.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_a_call_cut_by_max_tokens_comes_back_as_text_on_both_wires(oai, claude):
    cut = oai.responses.create(model=NAME, input=ASK, tools=[FUNCTION], tool_choice="required",
                               max_output_tokens=20, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert not calls_of(cut) and cut.output_text.startswith('{"tool_calls": [')
    message = claude.messages.create(model=NAME, max_tokens=20, tools=[TOOL],
                                     tool_choice={"type": "any"},
                                     messages=[{"role": "user", "content": ASK}])
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["text"]


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, timeout=60, headers={
        "content-type": "application/json", "x-api-key": KEY, **(headers or {})})


MESSAGE = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
BAD_MESSAGES = [
    (b"{not json", 400), ({**MESSAGE, "max_tokens": 0}, 400), ({**MESSAGE, "messages": []}, 400),
    ({k: v for k, v in MESSAGE.items() if k != "max_tokens"}, 400),
    ({**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400),
    ({**MESSAGE, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, 400),
    ({**MESSAGE, "messages": [{"role": "user", "content": "x" * 10_000_000}]}, 413),
    ({**MESSAGE, "model": "nope"}, 404), ({**MESSAGE, "temperature": 3}, 400)]


@pytest.mark.parametrize("body, status", BAD_MESSAGES)
def test_bad_messages_get_anthropics_error_shape(server, body, status):
    answer = post(server, "/v1/messages", body)
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] in (
        "invalid_request_error", "not_found_error", "request_too_large")
    assert error["error"]["message"]


def test_the_key_goes_as_x_api_key_or_bearer_and_a_wrong_one_is_refused_in_the_shape(server):
    assert post(server, "/v1/messages", MESSAGE).status_code == 200
    assert post(server, "/v1/messages", MESSAGE, {"x-api-key": "wrong"}).json()["error"][
        "type"] == "authentication_error"
    bearer = httpx.post(f"{server.base_url}/v1/responses", json={
        "model": NAME, "input": "hi", "max_output_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200 and bearer.json()["object"] == "response"
    refused = httpx.post(f"{server.base_url}/v1/responses", json={"model": NAME, "input": "hi"},
                         headers={"x-api-key": "wrong"}, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


RESPONSE = {"model": NAME, "input": "hi", "max_output_tokens": 4}
BAD_RESPONSES = [
    (b"[1, 2", 400), ({**RESPONSE, "input": []}, 400), ({**RESPONSE, "max_output_tokens": 0}, 400),
    ({**RESPONSE, "previous_response_id": "resp_1"}, 400),
    ({**RESPONSE, "input": [{"type": "function_call_output", "call_id": "nope",
                             "output": "x"}]}, 400),
    ({**RESPONSE, "tools": [FUNCTION], "tool_choice": {"type": "function", "name": "nope"}}, 400),
    ({**RESPONSE, "text": {"format": {"type": "json_schema", "name": "x",
                                      "schema": {"type": "object", "properties": {
                                          "a": {"type": "array", "uniqueItems": True}}},
                                      "strict": True}}}, 400),
    ({**RESPONSE, "model": "nope"}, 404)]


@pytest.mark.parametrize("body, status", BAD_RESPONSES)
def test_bad_responses_bodies_get_openais_error_shape_naming_the_field(server, body, status):
    answer = post(server, "/v1/responses", body)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if isinstance(body, dict) and status == 400 and "previous_response_id" in body:
        assert error["param"] == "previous_response_id"
