"""Compiling structured-output specs: errors that name what cannot be enforced, the bounds on
hostile inputs, the compile cache, and the bytes of each token of a vocabulary."""

from __future__ import annotations

import json
import threading

import pytest

from specserve.json_depth import MAX_DEPTH, text_depth
from specserve.sampling.grammar import GrammarCompiler
from specserve.sampling.grammar_source import MAX_REGEX_SIZE, regex_size
from specserve.sampling.structured import MAX_SPEC_CHARS, Structural, StructuredOutputsParams
from specserve.sampling.token_bytes import token_bytes
from tests.sampling.tiny_vocab import LOGITS_PAD, byte_level, logits_width, sentencepiece_style


@pytest.fixture(scope="module")
def compiler():
    tok = byte_level()
    return GrammarCompiler(tok, logits_width(tok))


def error_of(compiler, **spec) -> str:
    with pytest.raises(ValueError) as e:
        compiler.compile(StructuredOutputsParams(**spec))
    return str(e.value)


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    ("contains", {"type": "array", "contains": {"const": 1}}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}),
    ("not", {"properties": {"a": {"not": {"type": "string"}}}}),
    ("if", {"if": {"required": ["a"]}, "then": {"required": ["b"]}}),
])
def test_an_unsupported_schema_keyword_is_named(compiler, keyword, schema):
    message = error_of(compiler, json=schema)
    assert message.startswith("structured_outputs.json") and keyword in message
    message = error_of(compiler, structural=Structural("<a>", schema, "</a>"))
    assert message.startswith("structured_outputs.structural") and keyword in message


def test_the_library_cannot_be_told_to_ignore_keywords(compiler):
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    assert "uniqueItems" in error_of(compiler, json=schema)


@pytest.mark.parametrize("spec, words", [
    ({"regex": "[a-"}, ["structured_outputs.regex", "unclosed character class"]),
    ({"regex": "(?=a)b"}, ["structured_outputs.regex", "look-around"]),
    ({"json": {"type": "string", "pattern": "(?<=a)b"}}, ["structured_outputs.json", "look"]),
    ({"json": {"type": "strin"}}, ["structured_outputs.json", "strin"]),
    ({"json": {"$ref": "#/$defs/nowhere"}}, ["structured_outputs.json", "nowhere"]),
    ({"json": {"type": "string", "format": "zip-code"}}, ["structured_outputs.json", "zip-code"]),
])
def test_an_invalid_spec_is_a_value_error_naming_the_field(compiler, spec, words):
    message = error_of(compiler, **spec)
    assert all(w in message for w in words), message


@pytest.mark.parametrize("spec", [
    {"regex": "(a{1000}){1000}"},
    {"regex": "x{20000}"},
    {"json": {"type": "object", "properties": {"id": {"type": "string",
                                                      "pattern": "^([a-f]{300}-){300}$"}}}},
    {"json": {"type": "object", "patternProperties": {"^(ab{100}){200}$": {}}}},
])
def test_a_pathological_regex_is_refused_before_it_runs(compiler, spec, monkeypatch):
    """Refused by its size alone: llguidance is never handed it (no clock involved)."""
    from specserve.sampling import grammar, grammar_source

    class Unreachable:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the grammar reached llguidance")

        grammar_from_regex = grammar_from_json_schema = grammar_from_lark = __init__

    monkeypatch.setattr(grammar_source, "LLMatcher", Unreachable)
    monkeypatch.setattr(grammar, "LLMatcher", Unreachable)
    assert "too large" in error_of(compiler, **spec)


def test_a_schema_at_the_nesting_bound_compiles_and_one_beyond_is_refused_before_it(compiler):
    """The bound (`json_depth.MAX_DEPTH`) is below the library's own (its JSON parser stops at
    128 levels of the grammar it is handed), so every schema within it can be enforced."""
    schema: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH - 2):
        schema = {"type": "array", "items": schema}
    assert text_depth(json.dumps(schema)) == MAX_DEPTH - 1
    compiler.compile(StructuredOutputsParams(json={"type": "array", "items": schema}))
    for _ in range(2):
        schema = {"type": "array", "items": schema}
    assert error_of(compiler, json=schema).startswith(
        "structured_outputs.json.items.items.items.items.items.items...: JSON nested more than")


def test_a_spec_over_the_size_limit_is_refused():
    schema = {"type": "object", "properties": {f"key_{i}": {"type": "string"}
                                               for i in range(MAX_SPEC_CHARS // 20)}}
    assert len(json.dumps(schema)) > MAX_SPEC_CHARS
    with pytest.raises(ValueError, match="longer than"):
        StructuredOutputsParams(json=schema)


def test_regex_size_expands_counted_repetitions():
    assert regex_size("abc") == 3
    assert regex_size("a{10}") == 10 and regex_size("a{2,7}") == 7 and regex_size("a{4,}") == 4
    assert regex_size("(ab){3}c") == 7
    assert regex_size("((a{10}){10}){10}") == 1000
    assert regex_size(r"[{}(]{5}\{2\}") == 5 + 3  # braces and parentheses inside a class or escaped
    assert regex_size(r"\p{L}{50}") == 50
    assert regex_size("a*|b+") == 2
    assert regex_size(f"a{{{MAX_REGEX_SIZE + 1}}}") > MAX_REGEX_SIZE


def test_the_cache_returns_the_same_grammar_and_evicts_the_least_recent():
    tok = byte_level()
    compiler = GrammarCompiler(tok, logits_width(tok), cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=rx) for rx in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(b)
    assert compiler.compile(a) is first  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.compile(a) is first and compiler.compile(b) is not None
    assert compiler.compile(c) is not compiler.compile(a)


def test_compiling_from_threads_gives_one_grammar(compiler):
    schema = {"type": "object", "properties": {"t": {"type": "integer"}}}
    spec = StructuredOutputsParams(json=schema)
    found = []
    threads = [threading.Thread(target=lambda: found.append(compiler.compile(spec)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 4 and all(g is found[0] for g in found)


def test_byte_level_token_bytes():
    tok = byte_level()
    table = token_bytes(tok, logits_width(tok))
    ids = tok.encode("get weather\n")
    assert b"".join(table[i] for i in ids) == b"get weather\n"
    assert table[tok.backend.token_to_id("<tool_call>")] == b"<tool_call>"
    for never in ["<|endoftext|>", "<|im_end|>", "[PAD%d]" % (tok.vocab_size - 5)]:
        assert table[tok.backend.token_to_id(never)] is None, never
    assert table[tok.vocab_size:] == [None] * LOGITS_PAD


def test_sentencepiece_style_token_bytes():
    tok = sentencepiece_style()
    table = token_bytes(tok, tok.vocab_size)
    assert table[:3] == [None, None, None]
    assert table[tok.backend.token_to_id("<0x0A>")] == b"\n"
    assert table[tok.backend.token_to_id("▁ab")] == b" ab"
    assert table[tok.backend.token_to_id("é")] == "é".encode()


def test_an_unknown_vocabulary_kind_or_a_narrow_logits_width_is_refused():
    tok = sentencepiece_style()
    with pytest.raises(ValueError, match="smaller than"):
        token_bytes(tok, tok.vocab_size - 1)
    tok.backend.decoder = None
    with pytest.raises(ValueError, match="decoder"):
        token_bytes(tok, tok.vocab_size)


def test_the_schema_true_allows_any_json_value(compiler):
    tok = byte_level()
    grammar = compiler.compile(StructuredOutputsParams(json=True))
    for text in ['[1, "a"]', "42", '{"ok": null}']:
        m = grammar.matcher()
        assert all(m.accept(t) for t in tok.encode(text)) and m.can_terminate, text


def test_object_schemas_are_closed_unless_they_say_otherwise():
    """`additionalProperties` missing means none (xgrammar's default, llama.cpp's converter),
    through every nested schema; `true` or `patternProperties` keeps one open; an `allOf`
    member stays open (closing each part would refuse what the parts together allow)."""
    from specserve.sampling.grammar_source import closed_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"properties": {"d": {"const": {"x": 1}}}}},
        "e": {"type": "object", "additionalProperties": True},
        "f": {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
        "g": {"allOf": [{"type": "object", "properties": {"h": {"type": "object"}}}]}}}
    out = closed_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["properties"]["d"] == {"const": {"x": 1}}
    assert out["properties"]["e"]["additionalProperties"] is True
    assert "additionalProperties" not in out["properties"]["f"]
    member = out["properties"]["g"]["allOf"][0]
    assert "additionalProperties" not in member
    assert member["properties"]["h"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is not changed


def test_a_schema_not_marked_strict_takes_no_keys_beyond_its_own(compiler):
    """What instructor's JSON mode sends (a pydantic schema without additionalProperties): the
    output ends after the last property instead of adding keys until max_tokens."""
    tok = byte_level()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def takes(schema, text):
        m = compiler.compile(StructuredOutputsParams(json=schema)).matcher()
        return all(m.accept(t) for t in tok.encode(text)) and m.can_terminate

    assert takes(schema, '{"n": 1}') and not takes(schema, '{"n": 1, "m": 2}')
    assert takes({**schema, "additionalProperties": True}, '{"n": 1, "m": 2}')
