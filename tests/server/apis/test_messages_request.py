"""A Messages API body becomes the chat request the chat endpoint serves: the system prompt,
text, tool_use and tool_result blocks across turns, tools and tool_choice in their chat
shapes; thinking blocks left out; what is not text refused naming its block."""

from __future__ import annotations

import pytest

from specserve.server.apis.messages_request import (CountTokensRequest, MessagesRequest,
                                                    chat_body)
from specserve.server.protocol import ChatCompletionRequest

WEATHER = {"name": "get_weather", "description": "Weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def convert(model=MessagesRequest, **fields):
    body = chat_body(model.model_validate({"model": "m", "max_tokens": 64, **fields}))
    ChatCompletionRequest.model_validate(body)
    return body


def test_system_blocks_and_a_conversation_of_calls_and_results():
    body = convert(system=[{"type": "text", "text": "Be brief", "cache_control": {
        "type": "ephemeral"}}, {"type": "text", "text": "Use tools"}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And now?"}]},
        {"role": "system", "content": "Reminder"}], tools=[WEATHER],
        stop_sequences=["END"], top_k=5, temperature=0.2)
    system, user, assistant, result, again, reminder = body["messages"]
    assert system == {"role": "system", "content": "Be brief\nUse tools"}
    assert user == {"role": "user", "content": "Weather\nin Paris?"}
    assert assistant["content"] == "Checking." and assistant["tool_calls"] == [{
        "id": "toolu_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert result == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert again == {"role": "user", "content": "And now?"}
    assert reminder == {"role": "system", "content": "Reminder"}
    assert (body["stop"], body["top_k"], body["temperature"], body["max_tokens"]) == (
        ["END"], 5, 0.2, 64)
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": "Weather now"}}]


def test_an_error_result_says_so():
    body = convert(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "no such city", "is_error": True}]}],
        tools=[WEATHER])
    assert body["messages"][-1]["content"] == "Error: no such city"


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice_in_its_chat_shape(choice, chat):
    body = convert(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                   tool_choice={**choice, "disable_parallel_tool_use": True})
    assert body["tool_choice"] == chat and body["parallel_tool_calls"] is False


def test_anthropics_own_tools_are_left_out_and_unknown_fields_ignored():
    body = convert(messages=[{"role": "user", "content": "x"}], thinking={"type": "adaptive"},
                   context_management={"edits": []}, output_config={"effort": "high"},
                   metadata={"user_id": "u"},
                   tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}])
    assert [t["function"]["name"] for t in body["tools"]] == ["get_weather"]


def test_count_tokens_takes_the_body_without_max_tokens():
    body = chat_body(CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    assert "max_tokens" not in body


@pytest.mark.parametrize("messages, named", [
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
     "messages[0].content[0]"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                         "input": "x"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                    "content": [{"type": "image"}]}]}],
     "messages[0].content[0].content[0]"),
])
def test_what_is_not_text_or_not_in_its_place_is_refused_naming_the_block(messages, named):
    with pytest.raises(ValueError) as e:
        convert(messages=messages)
    assert str(e.value).startswith(named)
