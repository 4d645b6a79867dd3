"""What a request's output is held to, per tool_choice, response_format and
structured_outputs: the tool-call grammars compiled on a byte-level vocabulary (what each
accepts and refuses), and text in every form a grammar holds reading back as the same calls."""

from __future__ import annotations

import json

import pytest

from specserve.sampling.grammar import GrammarCompiler
from specserve.sampling.structured import StructuredOutputsParams
from specserve.server.errors import APIError
from specserve.server.limits import ServerLimits
from specserve.server.preparation import ModelLimits, completion_jobs
from specserve.server.protocol import CompletionRequest
from specserve.server.tool_calls.families import FORMATS, GENERIC, HERMES, LLAMA3_JSON, MISTRAL
from specserve.server.tool_calls.parser import parse_output
from tests.sampling.tiny_vocab import byte_level, logits_width
from tests.server.tool_calls import templates
from tests.server.tool_calls.requests import ASKED, WEATHER_TOOL, job
from tests.tiny import CHAT_TEMPLATE

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}, "strict": True}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
UTC = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
UNDECLARED = '{"name": "send_email", "arguments": {"to": "x"}}'
EXTRA_KEY = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


@pytest.fixture(scope="module")
def hermes_tok(tmp_path_factory):
    template = "{% for m in messages %}{{ m['content'] }}<tool_call>{% endfor %}"
    return templates.char_tokenizer(tmp_path_factory.mktemp("h"), ["<s>", "</s>"], template)


@pytest.fixture(scope="module")
def generic_tok(tmp_path_factory):
    return templates.char_tokenizer(tmp_path_factory.mktemp("g"), ["<s>", "</s>", "<|im_start|>",
                                                                   "<|im_end|>"], CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_tok(tmp_path_factory):
    return templates.char_tokenizer(tmp_path_factory.mktemp("l"), templates.LLAMA3_SPECIALS,
                                    templates.LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def compiler():
    tok = byte_level()
    return GrammarCompiler(tok, logits_width(tok))


def constraint(tok, **fields) -> StructuredOutputsParams | None:
    return job(tok, [ASKED], **fields).params.structured_outputs


def accepts(compiler, spec: StructuredOutputsParams, text: str, whole: bool = True) -> bool:
    """Whether the grammar of `spec` takes `text` (`whole`: as the entire output)."""
    m = compiler.compile(spec).matcher()
    return all(m.accept(t) for t in byte_level().encode(text)) and (not whole or m.can_terminate)


def test_required_holds_the_output_to_declared_calls_in_the_native_syntax(hermes_tok, compiler):
    spec = constraint(hermes_tok, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert spec.kind == "grammar"
    block = "<tool_call>\n{}\n</tool_call>"
    assert accepts(compiler, spec, block.format(PARIS))
    assert accepts(compiler, spec, block.format(PARIS + "\n</tool_call>\n<tool_call>\n" + UTC))
    for wrong in ("Sure. " + block.format(PARIS), block.format(UNDECLARED),
                  block.format(EXTRA_KEY), PARIS):
        assert not accepts(compiler, spec, wrong, whole=False), wrong


def test_a_named_function_alone_and_one_call_without_parallel_calls(generic_tok, compiler):
    spec = constraint(generic_tok, tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert accepts(compiler, spec, '{"tool_calls": [' + PARIS + "]}")
    assert not accepts(compiler, spec, '{"tool_calls": [' + UTC + "]}", whole=False)
    assert not accepts(compiler, spec, '{"tool_calls": [' + PARIS + ", " + PARIS, whole=False)
    assert job(generic_tok, [ASKED], tools=[WEATHER_TOOL], parallel_tool_calls=False
               ).tool_calls.max_calls == 1


def test_auto_lets_the_model_talk_and_holds_every_call_it_starts_to_a_declared_function(
        hermes_tok, compiler):
    spec = constraint(hermes_tok, tools=[WEATHER_TOOL, TIME_TOOL])
    assert spec.kind == "grammar"
    assert accepts(compiler, spec, "It is sunny in Paris. ```python\nprint(1)\n```")
    for text in ("Let me check.\n<tool_call>\n" + PARIS + "\n</tool_call>",
                 "```json\n" + PARIS + "\n```", "  " + PARIS, PARIS + "\n<tool_call>\n" + UTC
                 + "\n</tool_call>", "<tool_call>\n" + UTC + "\n</tool_call> Done."):
        assert accepts(compiler, spec, text), text
    for text in ("<tool_call>\n" + UNDECLARED, "ok ```json\n" + UNDECLARED, UNDECLARED,
                 "<tool_call>\n" + EXTRA_KEY, "<tool_call>\n" + PARIS + " and more",
                 '{\n  "name": "send_email"', 'See:\n```\n{"name": "send_email"'):
        assert not accepts(compiler, spec, text, whole=False), text
    # a call written with other whitespace starts the constraint all the same
    for text in ('{\n  "name": "get_weather", "arguments": {"city": "Paris"}}',
                 '```\n{"name":"get_weather", "arguments": {"city": "Paris"}}\n```'):
        assert accepts(compiler, spec, text), text
    parsing = job(hermes_tok, [ASKED], tools=[WEATHER_TOOL, TIME_TOOL]).tool_calls
    assert parsing.names == frozenset({"get_weather", "get_time"})


def test_allowed_tools_show_every_tool_and_hold_calls_to_those_listed(hermes_tok, compiler):
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    made = job(hermes_tok, [ASKED], tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=allowed)
    spec = made.params.structured_outputs
    assert accepts(compiler, spec, "<tool_call>\n" + UTC + "\n</tool_call>")
    assert not accepts(compiler, spec, "<tool_call>\n" + PARIS, whole=False)
    assert made.tool_calls.names == frozenset({"get_time"})
    auto = {"type": "allowed_tools", "allowed_tools": {**allowed["allowed_tools"], "mode": "auto"}}
    assert accepts(compiler, constraint(hermes_tok, tools=[WEATHER_TOOL, TIME_TOOL],
                                        tool_choice=auto), "No call needed.")


def test_a_tool_not_marked_strict_skips_keywords_the_engine_cannot_enforce(hermes_tok, compiler):
    odd = {"type": "function", "function": {"name": "fetch", "parameters": {
        "type": "object", "properties": {"url": {"type": "string", "format": "uri-reference"}}}}}
    spec = constraint(hermes_tok, tools=[odd], tool_choice="required")
    assert accepts(compiler, spec, '<tool_call>\n{"name": "fetch", "arguments": '
                                   '{"url": "a/b"}}\n</tool_call>')
    strict = {"type": "function", "function": {**odd["function"], "strict": True}}
    with pytest.raises(ValueError, match="format"):
        compiler.compile(constraint(hermes_tok, tools=[strict], tool_choice="required"))


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
    assert forced.kind == "grammar"
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
def test_every_form_a_grammar_holds_parses_back_to_the_same_calls(fmt):
    """The canonical block (`required`) and each form that starts a call under "auto", as
    the grammar writes them: what the family's parser takes as its calls."""
    key = fmt.arguments_key
    calls = [{"name": "get_weather", key: {"city": "Paris"}},
             {"name": "get_time", key: {"zone": "UTC"}}]
    texts = [(fmt.begin + fmt.separator.join(json.dumps(c) for c in calls) + fmt.end, calls)]
    for form in fmt.forms:
        some = calls if form.separator is not None else calls[:1]
        first = json.dumps(some[0])
        first = first[len('{"name": '):] if form.named else first
        rest = "".join(form.separator + json.dumps(c) for c in some[1:])
        texts.append((form.trigger + form.before + first + rest + form.after, some))
    for text, some in texts:
        parsed = parse_output(fmt, text, names=frozenset({"get_weather", "get_time"}))
        assert parsed.content == "" and [(n, json.loads(a)) for n, a in parsed.calls] == [
            (c["name"], c[key]) for c in some], text


def test_every_family_has_a_form_that_starts_a_call_under_auto():
    assert all(fmt.forms for fmt in FORMATS)
    assert [f.trigger for f in HERMES.forms] == ["<tool_call>", "```json", '```{"name": ',
                                                 '{"name": ']
    assert not any(f.anywhere for f in LLAMA3_JSON.forms + GENERIC.forms)
    assert MISTRAL.forms[0].trigger == "[TOOL_CALLS]"


def test_formats_without_a_marker_hold_a_bare_call_opening_the_output(llama3_tok, compiler):
    assert job(llama3_tok, [ASKED], tools=[WEATHER_TOOL]).tool_calls.format is LLAMA3_JSON
    spec = constraint(llama3_tok, tools=[WEATHER_TOOL, TIME_TOOL])
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert accepts(compiler, spec, bare) and accepts(compiler, spec, "Paris is sunny.")
    assert not accepts(compiler, spec, '{"name": "send_email", "parameters": {}}', whole=False)
    required = constraint(llama3_tok, tools=[WEATHER_TOOL], tool_choice="required")
    assert accepts(compiler, required, bare) and not accepts(compiler, required, "Hi", False)
