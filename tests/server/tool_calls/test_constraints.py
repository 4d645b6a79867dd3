"""What a request's output is held to, per tool_choice, response_format and
structured_outputs, and text in each family's `Structural` reading back as the same calls."""

from __future__ import annotations

import json

import pytest

from specserve.sampling.structured import Structural, StructuredOutputsParams
from specserve.server.errors import APIError
from specserve.server.limits import ServerLimits
from specserve.server.preparation import ModelLimits, completion_jobs
from specserve.server.protocol import CompletionRequest
from specserve.server.tool_calls.constraints import call_schema
from specserve.server.tool_calls.families import FORMATS, GENERIC, HERMES, LLAMA3_JSON
from specserve.server.tool_calls.parser import parse_output
from tests.server.tool_calls import templates
from tests.server.tool_calls.requests import ASKED, WEATHER_TOOL, job
from tests.tiny import CHAT_TEMPLATE

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}, "strict": True}}
WEATHER_PARAMS = WEATHER_TOOL["function"]["parameters"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def hermes_tok(tmp_path_factory):
    template = "{% for m in messages %}{{ m['content'] }}<tool_call>{% endfor %}"
    return templates.char_tokenizer(tmp_path_factory.mktemp("h"), ["<s>", "</s>"], template)


@pytest.fixture(scope="module")
def generic_tok(tmp_path_factory):
    return templates.char_tokenizer(tmp_path_factory.mktemp("g"), ["<s>", "</s>", "<|im_start|>",
                                                                   "<|im_end|>"], CHAT_TEMPLATE)


def constraint(tok, **fields) -> StructuredOutputsParams | None:
    return job(tok, [ASKED], **fields).params.structured_outputs


def test_required_holds_the_output_to_calls_of_any_tool_in_the_native_syntax(hermes_tok):
    got = constraint(hermes_tok, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    strict_time = {**TIME_TOOL["function"]["parameters"], "additionalProperties": False}
    assert got.structural == Structural(
        "<tool_call>\n", {"anyOf": [call_schema("get_weather", "arguments", WEATHER_PARAMS),
                                    call_schema("get_time", "arguments", strict_time)]},
        "\n</tool_call>", "\n</tool_call>\n<tool_call>\n", triggered=False)
    assert call_schema("f", "arguments", None)["properties"]["arguments"] == {"type": "object"}


def test_a_named_function_alone_and_one_call_without_parallel_calls(generic_tok):
    got = constraint(generic_tok, tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert got.structural == Structural('{"tool_calls": [', call_schema(
        "get_weather", "arguments", WEATHER_PARAMS), "]}", None, triggered=False)
    assert job(generic_tok, [ASKED], tools=[WEATHER_TOOL], parallel_tool_calls=False
               ).tool_calls.max_calls == 1


def test_auto_with_a_strict_tool_triggers_at_the_marker_and_loose_tools_take_any_object(
        hermes_tok):
    got = constraint(hermes_tok, tools=[WEATHER_TOOL, TIME_TOOL]).structural
    assert got.triggered and got.begin == "<tool_call>\n"
    assert got.schema["anyOf"][0] == call_schema("get_weather", "arguments", None)
    strict = got.schema["anyOf"][1]["properties"]["arguments"]  # strict: nothing beyond its own
    assert strict == {**TIME_TOOL["function"]["parameters"], "additionalProperties": False}
    assert constraint(hermes_tok, tools=[WEATHER_TOOL]) is None  # nothing strict: no grammar


def test_response_format_and_structured_outputs_become_their_constraints(hermes_tok):
    schema_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    assert constraint(hermes_tok, response_format=schema_format) == StructuredOutputsParams(
        json=SCHEMA)
    assert constraint(hermes_tok, response_format={"type": "json_object"}).json_object
    assert constraint(hermes_tok, response_format={"type": "text"}) is None
    choice = constraint(hermes_tok, structured_outputs={"choice": ["yes", "no"]})
    assert choice.choice == ("yes", "no")
    assert constraint(hermes_tok, structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    # a required call wins over the response format; the response format over strict "auto"
    forced = constraint(hermes_tok, tools=[TIME_TOOL], tool_choice="required",
                        response_format=schema_format)
    assert forced.kind == "structural"
    assert constraint(hermes_tok, tools=[TIME_TOOL], response_format=schema_format).kind == "json"


def test_text_completions_take_response_format_and_structured_outputs(hermes_tok):
    limits = ModelLimits("m", 4096, hermes_tok.vocab_size, speculative=False)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    (made,) = completion_jobs(req, hermes_tok, limits, ServerLimits())
    assert made.params.structured_outputs == StructuredOutputsParams(json=SCHEMA)


class RecordingCompiler:
    """A compiler that refuses what it is told to and records what it compiled."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.seen = refuse, []

    def compile(self, spec: StructuredOutputsParams) -> object:
        if self.refuse:
            raise ValueError(self.refuse)
        self.seen.append(spec)
        return ("compiled", spec.key())


def test_the_compiler_gets_the_constraint_and_its_refusal_is_a_400_naming_the_field(hermes_tok):
    compiler = RecordingCompiler()
    made = job(hermes_tok, [ASKED], compiler, tools=[TIME_TOOL], tool_choice="required")
    assert compiler.seen == [made.params.structured_outputs]
    job(hermes_tok, [ASKED], compiler)
    assert len(compiler.seen) == 1  # no constraint: nothing compiled
    refusing = RecordingCompiler("the keyword 'patternProperties' is not supported")
    for fields, param in [({"tools": [TIME_TOOL], "tool_choice": "required"}, "tools"),
                          ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"structured_outputs": {"regex": "a"}}, "structured_outputs")]:
        with pytest.raises(APIError) as info:
            job(hermes_tok, [ASKED], refusing, **fields)
        assert info.value.status == 400 and info.value.param == param
        assert "patternProperties" in info.value.message


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_calls_written_as_the_grammar_holds_them_parse_back_to_the_same_calls(fmt):
    """`Structural` read as begin value (separator value)* end: what each family's parser
    takes as its calls."""
    calls = [{"name": "get_weather", fmt.arguments_key: {"city": "Paris"}},
             {"name": "get_time", fmt.arguments_key: {"zone": "UTC"}}]
    for some in (calls[:1], calls):
        text = fmt.begin + fmt.separator.join(json.dumps(c) for c in some) + fmt.end
        parsed = parse_output(fmt, text)
        assert parsed.content == "" and [(n, json.loads(a)) for n, a in parsed.calls] == [
            (c["name"], c[fmt.arguments_key]) for c in some]


def test_formats_without_a_marker_get_no_trigger(tmp_path):
    tok = templates.char_tokenizer(tmp_path, templates.LLAMA3_SPECIALS, templates.LLAMA3_TEMPLATE)
    assert job(tok, [ASKED], tools=[WEATHER_TOOL]).tool_calls.format is LLAMA3_JSON
    assert constraint(tok, tools=[TIME_TOOL]) is None
    assert constraint(tok, tools=[TIME_TOOL], tool_choice="required").structural.begin == ""
    assert GENERIC.begin and HERMES.begin


def test_strict_schemas_take_no_properties_beyond_their_own():
    from specserve.server.tool_calls.constraints import strict_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"properties": {"d": {"const": {"x": 1}}}}},
        "e": {"type": "object", "additionalProperties": True},
        "f": {"type": "object", "patternProperties": {"^x": {"type": "string"}}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["properties"]["d"] == {"const": {"x": 1}}
    assert out["properties"]["e"]["additionalProperties"] is True
    assert "additionalProperties" not in out["properties"]["f"]
    assert "additionalProperties" not in schema  # the request's own schema is not changed
