"""A Responses API body becomes the chat request the chat endpoint serves: items, tools
(function, custom, namespaced, hosted ones left out), tool_choice and text.format in their
chat shapes; what needs stored state, or is not text, is refused naming its field."""

from __future__ import annotations

import pytest

from specserve.server.apis.responses_request import ResponsesRequest, chat_body
from specserve.server.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": True}


def convert(**fields):
    body, names = chat_body(ResponsesRequest.model_validate({"model": "m", **fields}))
    ChatCompletionRequest.model_validate(body)  # the chat endpoint takes what it becomes
    return body, names


def test_a_string_input_and_instructions_are_a_system_and_a_user_message():
    body, _ = convert(input="Hello", instructions="Be brief", max_output_tokens=9,
                      temperature=0.5, top_p=0.9)
    assert body["messages"] == [{"role": "system", "content": "Be brief"},
                                {"role": "user", "content": "Hello"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (9, 0.5, 0.9)


def test_items_become_the_conversation_calls_joining_the_assistant_turn_before_them():
    body, _ = convert(input=[
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}], tools=[WEATHER])
    system, user, assistant, one, two = body["messages"]
    assert system == {"role": "system", "content": "a\nb"} and user["content"] == "Weather?"
    assert assistant["content"] == "Checking."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert (one, two) == ({"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                          {"role": "tool", "tool_call_id": "call_2", "content": "rain"})


def test_tools_in_their_chat_shape_custom_and_namespaced_ones_remembered_hosted_ones_left_out():
    custom = {"type": "custom", "name": "apply_patch", "description": "Edit files"}
    group = {"type": "namespace", "name": "agents", "description": "sub-agents",
             "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}
    body, names = convert(input="x", tools=[WEATHER, custom, group, {"type": "web_search"}],
                          tool_choice={"type": "function", "name": "get_weather"},
                          parallel_tool_calls=False)
    functions = [t["function"] for t in body["tools"]]
    assert [f["name"] for f in functions] == ["get_weather", "apply_patch", "spawn"]
    assert functions[0]["strict"] is True and functions[0]["description"] == "Weather now"
    assert functions[1]["parameters"]["properties"] == {"input": {"type": "string"}}
    assert names.custom == {"apply_patch"} and names.namespace == {"spawn": "agents"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    allowed = convert(input="x", tools=[WEATHER], tool_choice={
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}]})[0]["tool_choice"]
    assert allowed["allowed_tools"]["mode"] == "required"


def test_a_custom_tools_call_and_output_come_back_as_a_call_of_one_string():
    body, _ = convert(input=[
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"}],
        tools=[{"type": "custom", "name": "apply_patch"}])
    call = body["messages"][1]["tool_calls"][0]["function"]
    assert call == {"name": "apply_patch", "arguments": '{"input": "*** Begin"}'}


def test_text_format_becomes_the_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    body, _ = convert(input="x", text={"format": {"type": "json_schema", "name": "n",
                                                  "schema": schema, "strict": True}})
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": True}}
    assert convert(input="x", text={"format": {"type": "json_object"}})[0][
        "response_format"] == {"type": "json_object"}
    assert "response_format" not in convert(input="x", text={"format": {"type": "text"}})[0]


def test_fields_this_server_does_not_use_are_ignored_and_known_ones_still_checked():
    body, _ = convert(input="x", store=False, include=["reasoning.encrypted_content"],
                      reasoning={"summary": "auto"}, prompt_cache_key="k", client_metadata={})
    assert body["messages"] == [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "temperature": "hot"})


@pytest.mark.parametrize("fields, named", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice"),
])
def test_what_cannot_be_served_is_refused_naming_its_field(fields, named):
    with pytest.raises(ValueError) as e:
        convert(**{"input": "x", **fields})
    assert str(e.value).startswith(named)
