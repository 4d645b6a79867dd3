"""The grammar that holds a model's tool calls (a Lark grammar in llguidance's dialect, compiled
as `StructuredOutputsParams(grammar=...)`).

A call is `{"name": "<name>", "<arguments key>": <arguments>}` with one alternative per
function, so its name is always a declared one and its arguments follow that function's
schema (closed objects unless the schema opens them, `grammar_source.closed_schema`; for a
function not marked strict, keywords the engine cannot enforce are skipped, not refused).
Schemas lose their annotations (`description`, `title`, ...) here: they constrain nothing.

- `required` (tool_choice "required" or a named function): the output is the format's
  canonical block, `begin call (separator call)* end`;
- otherwise ("auto"): free text, and wherever one of the format's `CallForm` triggers is
  written (its marker, a ```json fence, a bare `{"name": ` opening the output), the rest of
  that call is held to the grammar: llguidance's lazy lexemes end at the first trigger, as
  llama.cpp's lazy grammars do. A trigger matches with any whitespace between its JSON tokens
  (`{\n  "name":` starts a call as `{"name": ` does; a lazy match ends before the whitespace
  after its last token, which `SPACE` then takes); what it holds after is written compactly.
  After a call, free text again (where another call may start, unless `parallel` is false).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specserve.sampling.grammar_source import json_rule
from specserve.server.tool_calls.families import CallForm, ToolFormat

ANY_OBJECT = {"type": "object", "additionalProperties": True}
ANNOTATIONS = frozenset({"description", "title", "examples", "$comment", "deprecated",
                         "readOnly", "writeOnly"})
_DATA = ("const", "enum", "default")  # JSON data in a schema, not schemas
WHITESPACE = "[ \\t\\r\\n]*"
_TOKENS = re.compile(r'"[^"]*"|[{}\[\]:,]|[^{}\[\]:,"\s]+')


@dataclass(frozen=True)
class Function:
    """A function a call may name: its parameters' schema (None: any object) and whether it
    was marked strict."""

    name: str
    parameters: dict | None = None
    strict: bool = False


def tool_call_grammar(functions: list[Function], fmt: ToolFormat, required: bool,
                      parallel: bool = True) -> str:
    """The Lark grammar of calls to `functions` in `fmt` (see the module doc)."""
    lines = ["%llguidance {}", *_call_rules(functions, fmt.arguments_key)]
    if required:
        lines.append("start: " + _block(fmt.begin, "call", fmt.separator if parallel else None,
                                        fmt.end))
        return "\n".join(lines) + "\n"
    leads = [f for f in fmt.forms if not f.anywhere]
    segs = [f for f in fmt.forms if f.anywhere]
    for kind, forms in (("lead", leads), ("seg", segs)):
        for i, form in enumerate(forms):
            prefix = "TEXT " if form.anywhere else ""
            lines.append(f"{kind}{i}_head[lazy]: {prefix}{trigger_regex(form, not form.anywhere)}")
            space = "SPACE? " if form.trigger.rstrip()[-1:] in "{[:," else ""
            lines.append(f"{kind}{i}: {kind}{i}_head {space}{_body(form, parallel)}")
        if forms:
            lines.append(f"{kind}: " + " | ".join(f"{kind}{i}" for i in range(len(forms))))
    if parallel:
        lead = "(lead)? " if leads else ""
        seg = "(seg)* " if segs else ""
        lines.append(f"start: {lead}{seg}TEXT")
    else:
        starts = [f"{kind} TEXT" for kind, forms in (("lead", leads), ("seg", segs)) if forms]
        lines.append("start: " + " | ".join([*starts, "TEXT"]))
    lines.append("TEXT: /(?s:.*)/")
    lines.append(f"SPACE: /{WHITESPACE[:-1]}+/")
    return "\n".join(lines) + "\n"


def trigger_regex(form: CallForm, leading_space: bool) -> str:
    """The Lark regex of a trigger: its tokens with any whitespace between them (and before
    them, `leading_space`)."""
    tokens = [re.escape(t) for t in _TOKENS.findall(form.trigger)]
    body = WHITESPACE.join(tokens)
    return "/" + (WHITESPACE if leading_space else "") + body.replace("/", "\\/") + "/"


def _call_rules(functions: list[Function], arguments_key: str) -> list[str]:
    """`call` (a whole call) and `named` (a call after its `{"name": `), one alternative per
    function."""
    if not functions:
        raise ValueError("tools: no function a call could name")
    lines = ['call: "{\\"name\\": " named']
    for i, f in enumerate(functions):
        head = f"{json.dumps(f.name)}, {json.dumps(arguments_key)}: "
        schema = ANY_OBJECT if f.parameters is None else without_annotations(f.parameters)
        lines.append(f'fn{i}: {_literal(head)} args{i} "}}"')
        lines.append(f"args{i}: {json_rule(schema, f'tools[{f.name}].parameters', not f.strict)}")
    lines.append("named: " + " | ".join(f"fn{i}" for i in range(len(functions))))
    return lines


def _body(form: CallForm, parallel: bool) -> str:
    first = "named" if form.named else "call"
    separator = form.separator if parallel else None
    return _block(form.before, first, separator, form.after)


def _block(begin: str, first: str, separator: str | None, end: str) -> str:
    parts = [_literal(begin)] if begin else []
    parts.append(first)
    if separator is not None:
        parts.append(f"({_literal(separator)} call)*")
    if end:
        parts.append(_literal(end))
    return " ".join(parts)


def without_annotations(schema: object) -> object:
    """`schema` without the keywords that only describe (`ANNOTATIONS`), in every nested
    schema; JSON data (`const`, `enum`, `default`) as it is, and `properties` keep every name
    (a property may be called `description`)."""
    if isinstance(schema, list):
        return [without_annotations(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions") \
                and isinstance(value, dict):
            out[key] = {name: without_annotations(s) for name, s in value.items()}
        elif key not in ANNOTATIONS:
            out[key] = without_annotations(value)
    return out


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
