"""The agents' wires render an output as their APIs document: streamed events in the
documented order that reassemble to the body a non-streamed request gets (ids aside), calls
given whole (a call cut short is text), and each API's stop reasons."""

from __future__ import annotations

import json

import pytest

from specserve.engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from specserve.server.apis.messages_render import MessagesRenderer
from specserve.server.apis.responses_render import ResponsesRenderer
from specserve.server.apis.responses_request import ResponsesRequest, ToolNames
from specserve.server.errors import APIError
from specserve.server.tool_calls.families import HERMES
from specserve.server.tool_calls.parser import ToolParsing

PARSING = ToolParsing(HERMES, None, frozenset({"get_weather", "apply_patch"}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {
    "text": ("The answer is 42.", "stop", None),
    "call": ("Let me check.\n" + CALL, "stop", None),
    "two calls": (CALL + "\n" + CALL.replace("Paris", "Rome"), "stop", None),
    "cut call": ("Checking.\n" + CALL[:40], "length", None),
    "stop string": ("Done", "stop", "END"),
    "empty": ("", "stop", None),
}


def output(text: str, finish: str, stop: str | None) -> RequestOutput:
    c = CompletionOutput(0, text, [1] * max(1, len(text) // 4), finish, max(1, len(text) // 4),
                         0.1, 0.2, 0.3, stop_reason=stop)
    return RequestOutput("r", None, [1, 2, 3], [c], True, num_cached_tokens=2)


def deltas(text: str, finish: str, pieces: int = 7) -> list[CompletionDelta]:
    cuts = sorted({len(text) * k // pieces for k in range(pieces + 1)})
    parts = [text[a:b] for a, b in zip(cuts, cuts[1:])] or [""]
    return [CompletionDelta(0, [], p, None, [], finish if i == len(parts) - 1 else None)
            for i, p in enumerate(parts)]


def events(renderer, text: str, finish: str, stop: str | None) -> list[tuple[str, dict]]:
    raw = renderer.start()
    steps = deltas(text, finish)
    for i, d in enumerate(steps):
        step = renderer.step(0, [d])
        raw += renderer.close([output(text, finish, stop)], step) if i == len(steps) - 1 else step
    return [parse(e) for e in raw]


def parse(event: str) -> tuple[str, dict]:
    head, data = event.strip().split("\n")
    assert head.startswith("event: ") and data.startswith("data: ")
    payload = json.loads(data[len("data: "):])
    assert payload["type"] == head[len("event: "):]
    return payload["type"], payload


def without_ids(value):
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def responses(parsing=PARSING) -> ResponsesRenderer:
    req = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    return ResponsesRenderer(req, ToolNames(), parsing, True)


@pytest.mark.parametrize("name", TEXTS)
def test_responses_stream_reassembles_to_the_body_in_the_documented_order(name):
    text, finish, stop = TEXTS[name]
    got = events(responses(), text, finish, stop)
    body = responses().body([output(text, finish, stop)])
    kinds = [k for k, _ in got]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [p["sequence_number"] for _, p in got] == list(range(len(got)))
    final = got[-1][1]["response"]
    assert without_ids(final) == without_ids({**body, "created_at": final["created_at"]})
    done = [p["item"] for k, p in got if k == "response.output_item.done"]
    assert done == final["output"]
    for item in final["output"]:  # each item's deltas reassemble to it
        if item["type"] == "message":
            text_deltas = "".join(p["delta"] for k, p in got if p.get("item_id") == item["id"]
                                  and k == "response.output_text.delta")
            assert text_deltas == item["content"][0]["text"]
        else:
            args = "".join(p["delta"] for k, p in got if p.get("item_id") == item["id"]
                           and k == "response.function_call_arguments.delta")
            assert json.loads(args) == json.loads(item["arguments"])
    assert final["status"] == ("incomplete" if finish == "length" else "completed")
    assert kinds[-1] == ("response.incomplete" if finish == "length" else "response.completed")
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert "speculative_stats" in final


def test_responses_give_calls_as_function_call_items_and_a_cut_call_as_text():
    body = responses().body([output(*TEXTS["call"])])
    message, call = body["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    cut = responses().body([output(*TEXTS["cut call"])])
    assert [i["type"] for i in cut["output"]] == ["message"]
    assert cut["output"][0]["content"][0]["text"] == TEXTS["cut call"][0]
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert responses().body([output(*TEXTS["empty"])])["output"][0]["content"][0]["text"] == ""


def test_responses_custom_and_namespaced_calls_in_their_item_shapes():
    names = ToolNames(custom={"apply_patch"}, namespace={"get_weather": "weather"})
    req = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    text = CALL + "\n" + CALL.replace("get_weather", "apply_patch").replace(
        '{"city": "Paris"}', '{"input": "*** Begin Patch"}')
    body = ResponsesRenderer(req, names, PARSING, True).body([output(text, "stop", None)])
    function, custom = body["output"]
    assert function["namespace"] == "weather"
    assert custom["type"] == "custom_tool_call" and custom["input"] == "*** Begin Patch"


def test_a_responses_failure_mid_stream_is_an_error_event_then_response_failed():
    renderer = responses()
    renderer.start()
    kinds = [parse(e)[0] for e in renderer.failure(APIError(504, "too slow", code="timeout"))]
    assert kinds == ["error", "response.failed"]


def messages(parsing=PARSING) -> MessagesRenderer:
    return MessagesRenderer("m", 3, parsing, True)


@pytest.mark.parametrize("name", TEXTS)
def test_messages_stream_reassembles_to_the_body_in_the_documented_order(name):
    text, finish, stop = TEXTS[name]
    got = events(messages(), text, finish, stop)
    body = messages().body([output(text, finish, stop)])
    kinds = [k for k, _ in got]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                      "message_stop"]
    blocks: dict[int, dict] = {}
    for kind, p in got:
        if kind == "content_block_start":
            blocks[p["index"]] = dict(p["content_block"], partial="")
        elif kind == "content_block_delta":
            block, delta = blocks[p["index"]], p["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["partial"] += delta["partial_json"]
    content = []
    for i in sorted(blocks):
        block = blocks[i]
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
        content.append(block)
    assert without_ids(content) == without_ids(body["content"])
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": body["stop_reason"],
                              "stop_sequence": body["stop_sequence"]}
    assert delta["usage"] == body["usage"] and body["usage"]["cache_read_input_tokens"] == 2


@pytest.mark.parametrize("name, reason, sequence", [
    ("text", "end_turn", None), ("call", "tool_use", None), ("cut call", "max_tokens", None),
    ("stop string", "stop_sequence", "END")])
def test_messages_stop_reasons(name, reason, sequence):
    body = messages().body([output(*TEXTS[name])])
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
    if name == "call":
        text, call = body["content"]
        assert text == {"type": "text", "text": "Let me check."}
        assert call["type"] == "tool_use" and call["input"] == {"city": "Paris"}
        assert call["id"].startswith("toolu_")
    if name == "cut call":
        assert [b["type"] for b in body["content"]] == ["text"]


def test_a_messages_failure_mid_stream_is_an_error_event_in_anthropics_shape():
    (event,) = messages().failure(APIError(503, "engine dead", code="engine_dead"))
    kind, payload = parse(event)
    assert kind == "error" and payload["error"] == {"type": "overloaded_error",
                                                     "message": "engine dead"}


def test_without_tools_the_whole_output_is_text():
    body = messages(parsing=None).body([output(CALL, "stop", None)])
    assert body["content"] == [{"type": "text", "text": CALL}]
    assert body["stop_reason"] == "end_turn"


def test_each_wire_keeps_a_quiet_stream_alive_with_an_event_its_clients_take():
    from specserve.server.responses import ChatRenderer

    assert [parse(e)[0] for e in responses().keepalive()] == ["response.in_progress"]
    assert [parse(e)[0] for e in messages().keepalive()] == ["ping"]
    assert ChatRenderer(None).keepalive() == [": keep-alive\n\n"]
