"""One nesting bound for JSON, checked before anything recurses: texts scanned without
recursion (strings skipped), values walked with a stack of their own; beyond the bound a
ValueError naming the path to the first value too deep. The same bound refuses a deep
schema in `StructuredOutputsParams`, deep tools and tool arguments in a chat template's input,
and a deep body (or deep arguments text in it) in the server's body check, on any route."""

from __future__ import annotations

import json
import random

import pytest

from specserve import json_depth
from specserve.json_depth import MAX_DEPTH, NestedTooDeep, check_text, check_value, text_depth
from specserve.models.chat_template import check_messages, check_tools
from specserve.sampling.structured import Structural, StructuredOutputsParams
from specserve.server.intake import check_body

DEEP = "[" * 50_000 + "]" * 50_000  # far past Python's recursion limit


def nested(depth: int, leaf: object = 1) -> object:
    """`depth` lists inside one another around `leaf` (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def object_schema(depth: int) -> dict:
    """A JSON Schema `depth` levels deep as JSON (objects of one property, two levels each)."""
    schema: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(("text", "depth"), [
    ("1", 0), ('"[[["', 0), ("[]", 1), ('{"a": [1]}', 2), ('{"a": "}}]]", "b": [[]]}', 3),
    (r'["\"[", {"\\": [[]]}]', 4), (DEEP, 50_000)])
def test_text_depth_counts_brackets_outside_strings_for_str_and_bytes(text, depth):
    assert text_depth(text) == text_depth(text.encode()) == depth


def value_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(value_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(value_depth, value), default=0)
    return 0


def random_json(rng: random.Random, depth: int = 0) -> object:
    """A value whose strings hold brackets, quotes and backslashes (escaped by json.dumps)."""
    kind = rng.randrange(4 if depth < 8 else 2)
    if kind == 0:
        return "".join(rng.choice('ab[]{}"\\ ,:') for _ in range(rng.randrange(12)))
    if kind == 1:
        return rng.randrange(100)
    if kind == 2:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_json(rng, 8) if rng.random() < 0.5 else "k": random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def test_a_text_scanned_in_small_windows_has_the_depth_of_its_value():
    """Windows of 1 to 16 characters end inside strings and escapes all the time: each must
    grow to close its string, or a bracket inside a string would count (a window that simply
    cut the text gives other depths for 63 of these 200 texts; seed fixed)."""
    rng = random.Random(0)
    for _ in range(200):
        value = random_json(rng)
        text = json.dumps(value)
        want = text_depth(text, window=len(text) + 1)
        assert want == value_depth(value)
        for window in (1, 2, 3, 5, 16):
            assert text_depth(text, window) == text_depth(text.encode(), window) == want, text


def test_the_bound_itself_passes_and_one_beyond_is_refused_naming_the_path():
    at = json.dumps({"a": nested(MAX_DEPTH - 1)})
    check_text(at, "f")
    check_value(json.loads(at), "f")
    beyond = json.dumps({"a b": nested(MAX_DEPTH)})
    with pytest.raises(NestedTooDeep, match=r'^f\["a b"\]\[0\]\[0\]\[0\]\[0\]\[0\]\.\.\.: JSON '
                                           rf"nested more than {MAX_DEPTH} levels deep") as e:
        check_text(beyond, "f")
    assert e.value.field == "f"
    with pytest.raises(NestedTooDeep, match=r'^f\["a b"\]\[0\]'):
        check_value(json.loads(beyond), "f")


def test_a_text_python_cannot_parse_is_refused_without_recursing():
    with pytest.raises(RecursionError):  # what the check stands in front of
        json.loads(DEEP)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json\[0\]\[0\].*more than 64"):
        json_depth.loads(DEEP, "structured_outputs.json")
    looped: list = []
    looped.append(looped)  # a value that contains itself is infinitely deep
    with pytest.raises(ValueError, match=r"^v\[0\]\[0\]"):
        check_value(looped, "v")


def test_a_schema_nested_too_deep_is_a_value_error_naming_the_field():
    StructuredOutputsParams(json=object_schema(MAX_DEPTH))
    StructuredOutputsParams(json=json.dumps(object_schema(MAX_DEPTH)))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json\.properties\.a\.properties"):
        StructuredOutputsParams(json=object_schema(MAX_DEPTH + 2))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json\[0\]"):
        StructuredOutputsParams(json=DEEP)  # as text: refused before json.loads
    with pytest.raises(ValueError, match=r"^structured_outputs\.structural\.schema\.properties"):
        Structural("<call>", object_schema(300), "</call>")


def test_deep_tools_and_tool_arguments_are_refused_before_a_template_sees_them():
    tool = {"type": "function", "function": {"name": "f", "parameters": object_schema(300)}}
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters\.properties"):
        check_tools([tool])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments"
                                         r"\[0\]"):
        check_messages(messages, ("system", "user", "assistant"))
    call["function"]["arguments"] = json.dumps({"x": nested(10)})
    assert check_messages(messages, ("system", "user", "assistant"))[1]["tool_calls"][0][
        "function"]["arguments"] == {"x": nested(10)}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/v1/messages", "/v1/anything-new"])
def test_the_body_check_refuses_deep_bodies_on_every_route(path):
    body = '{"model": "m", "tools": [{"function": {"parameters": %s}}]}' % DEEP
    problem = check_body(path, body.encode(), max_messages=4, max_model_len=10)
    assert problem is not None and (problem.status, problem.code) == (400, "nested_too_deep")
    assert problem.param == "tools" and problem.message.startswith(
        "tools[0].function.parameters[0][0]...: JSON nested more than 64")
    assert check_body(path, json.dumps({"model": "m", "x": nested(MAX_DEPTH - 1)}).encode(),
                      4, 10) is None


def test_the_body_check_refuses_tool_arguments_text_nested_too_deep():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    body = {"model": "m", "messages": [{"role": "assistant", "tool_calls": [call]}]}
    problem = check_body("/v1/chat/completions", json.dumps(body).encode(), 4, 10)
    assert problem is not None and problem.code == "nested_too_deep"
    assert problem.message.startswith("messages[0].tool_calls[0].function.arguments[0]")
    call["function"]["arguments"] = json.dumps(nested(5))
    assert check_body("/v1/chat/completions", json.dumps(body).encode(), 4, 10) is None
