"""The grammar text (llguidance's input) of a `StructuredOutputsParams`, and the checks that
bound what it may cost.

JSON values are written compactly, as `json.dumps` writes them by default and as chat
templates render tool calls: `", "` between items, `": "` after keys, no other whitespace;
object properties come in the schema's order. So a schema's keys, constants and brackets
are forced text, which the grammar drafts.

- `json`: the schema's own grammar, closed (`closed_schema`: an object schema that does not set
  `additionalProperties` takes no other keys); a JSON Schema keyword the engine cannot enforce
  is an error naming it (llguidance's strict mode), never silently ignored (`lenient`, for
  the arguments of tools not marked strict, skips such keywords instead);
- `json_object`: `{"type": "object"}`;
- `regex`: Rust `regex` syntax (as Python's for common patterns), matching the whole output;
- `choice`: one of the strings, exactly;
- `structural`: `begin value (separator value)* end`, each value valid against the schema;
  `triggered`: any text first (or only), the constraint starting at the first `begin`;
- `grammar`: the Lark text as given (llguidance's dialect; `%json` values in it are written by
  `json_rule`, which checks and closes their schemas).

Cost bound: llguidance limits its own work per step (fuel), but a counted repetition expands
under its regex engine (`(a{1000}){1000}` is a million states), so every regex (the `regex`
itself, each schema `pattern` and `patternProperties` key) is refused past `MAX_REGEX_SIZE`:
its size with each counted repetition expanded.
"""

from __future__ import annotations

import json
import re

from llguidance import LLMatcher

from specserve.sampling.structured import Structural, StructuredOutputsParams

JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": False}
MAX_REGEX_SIZE = 10_000  # atoms of a regex with its counted repetitions expanded
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
_VALUES = ("const", "enum", "default", "examples")  # JSON data in a schema, not schemas
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`; ValueError naming the field where it cannot be."""
    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(json_schema(spec.json, "structured_outputs.json"))
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object", "x-guidance": JSON_FORMAT})
    if spec.regex is not None:
        check_regex(spec.regex, "structured_outputs.regex")
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(_literal, spec.choice)))
    if spec.grammar is not None:
        return LLMatcher.grammar_from_lark(spec.grammar)
    return LLMatcher.grammar_from_lark(structural_lark(spec.structural))


def json_schema(schema: dict | bool, field: str, lenient: bool = False) -> dict:
    """`schema` (`true`: any JSON value) closed, with the compact JSON format set; its regexes
    checked. `lenient`: keywords the engine cannot enforce are skipped, not refused."""
    if schema is True:
        schema = {}
    check_patterns(schema, field)
    return {**closed_schema(schema), "x-guidance": {**JSON_FORMAT, "lenient": lenient}}


def json_rule(schema: dict | bool, field: str, lenient: bool = False) -> str:
    """A Lark value holding one JSON value valid against `schema` (as `json_schema` gives it)."""
    return "%json " + json.dumps(json_schema(schema, field, lenient), ensure_ascii=False)


def closed_schema(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object schema that sets none of
    `additionalProperties`, `patternProperties`, `unevaluatedProperties`, through every
    nested schema (the direct members of an `allOf` aside: closing each part would refuse
    what the parts together allow). The schema given is not changed."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _VALUES:
            out[key] = value
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_open_parts(s) for s in value]
        else:
            out[key] = closed_schema(value)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not any(k in out for k in _OPENERS):
        out["additionalProperties"] = False
    return out


def _open_parts(schema: object) -> object:
    """A member of an `allOf`: its nested schemas closed, itself left as it is."""
    closed = closed_schema(schema)
    if isinstance(closed, dict) and isinstance(schema, dict) and not any(
            k in schema for k in _OPENERS):
        closed.pop("additionalProperties", None)
    return closed


def structural_lark(s: Structural) -> str:
    """A Lark grammar (llguidance's dialect) for text around JSON values."""
    value = json_rule(s.schema, "structured_outputs.structural.schema")
    body = "value"
    if s.separator is not None:
        body = f"value ({_literal(s.separator)} value)*" if s.separator else "value+"
    if s.end:
        body += f" {_literal(s.end)}"
    if s.triggered:
        start = (f"start: TEXT | head {body}\n"
                 f"head[lazy]: TEXT {_literal(s.begin)}\n"
                 "TEXT: /(?s:.*)/\n")
    else:
        start = f"start: {_literal(s.begin) if s.begin else ''} {body}\n"
    return f"%llguidance {{}}\n{start}value: {value}\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def check_patterns(schema: object, field: str) -> None:
    """Check each regex of a JSON Schema (`pattern` values, `patternProperties` keys)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_patterns(item, f"{field}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            check_regex(value, f"{field}.pattern")
        elif key == "patternProperties" and isinstance(value, dict):
            for rx in value:
                check_regex(rx, f"{field}.patternProperties")
        if key not in _VALUES:
            check_patterns(value, f"{field}.{key}")


def check_regex(regex: str, field: str) -> None:
    size = regex_size(regex)
    if size > MAX_REGEX_SIZE:
        raise ValueError(f"{field}: the regex {_short(regex)} is too large to enforce (about "
                         f"{size} atoms with its repetitions expanded; at most {MAX_REGEX_SIZE})")


def regex_size(regex: str) -> int:
    """The atoms of `regex` with every counted repetition (`{n}`, `{n,m}`, `{n,}`) expanded
    (an upper estimate: alternatives add up). A group's size is its content's; `*`, `+`, `?`
    count once; `x{n,}` counts n times."""
    sizes = [0]  # the size of each group open at this point, innermost last
    last = 0  # the size of the atom just read, which a quantifier multiplies
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i = _after_escape(regex, i)
            last = 1
        elif c == "[":
            i = _after_class(regex, i)
            last = 1
        elif c == "(":
            sizes.append(0)
            i += 1
            last = 0
            continue
        elif c == ")" and len(sizes) > 1:
            last = sizes.pop()
            i += 1
        elif c == "{" and (m := _COUNT.match(regex, i)):
            n = int(m.group(3) or m.group(1)) if m.group(2) is not None else int(m.group(1))
            sizes[-1] += last * (max(n, 1) - 1)
            last *= max(n, 1)
            i = m.end()
            continue
        else:
            last = 0 if c in "|*+?^$" else 1
            i += 1
        sizes[-1] += last
    return sum(sizes)


def _after_escape(regex: str, i: int) -> int:
    """The index after the escape at i (`\\p{L}`, `\\x{41}`, `\\u{41}` take their braces)."""
    if regex[i + 1:i + 2] in ("p", "P", "x", "u") and regex[i + 2:i + 3] == "{":
        close = regex.find("}", i + 3)
        return len(regex) if close < 0 else close + 1
    return i + 2


def _after_class(regex: str, i: int) -> int:
    """The index after the character class opened at i (nested classes included)."""
    depth, i = 0, i
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            if regex[i + 1:i + 2] == "^":
                i += 1
            if regex[i + 1:i + 2] == "]":  # a leading ] is a member
                i += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
