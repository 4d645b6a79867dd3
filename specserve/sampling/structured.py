"""What a request's output must match: `StructuredOutputsParams` (vLLM's name and fields).

Exactly one constraint per request:
- `json`: a JSON Schema (a dict, or its JSON text); the output is one JSON value valid
  against it;
- `json_object`: any JSON object;
- `regex`: the whole output matches the regular expression;
- `choice`: the output is exactly one of the strings;
- `structural`: text around JSON values (`Structural`), what a tool call in a model's
  native format is (e.g. `<tool_call>\\n{...}\\n</tool_call>`);
- `grammar`: a Lark grammar in llguidance's dialect (vLLM's `grammar`), e.g. the tool-call
  grammars the server builds (`server/tool_calls/call_grammar.py`).

JSON Schemas are closed: an object schema that does not set `additionalProperties` (nor
`patternProperties`) takes no properties beyond its own, strict or not (as xgrammar's default
and llama.cpp's converter); `additionalProperties: true` opens it (`grammar_source.py`).

This module only states and checks the request's shape (a schema nested deeper than
`json_depth.MAX_DEPTH` is refused here, before anything walks it); `sampling/grammar.py`
compiles it for the model's vocabulary (and refuses, naming it, any schema keyword it cannot
enforce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specserve import json_depth

KINDS = ("json", "json_object", "regex", "choice", "structural", "grammar")
MAX_SPEC_CHARS = 1 << 16  # characters of a schema, regex or choice list (as JSON text)
MAX_CHOICES = 256


@dataclass(frozen=True, slots=True)
class Structural:
    """`begin`, then one JSON value valid against `schema`, then `end`; where `separator`
    is not None, more values may follow, each after `separator` (parallel tool calls).
    `triggered`: free text may come first, and the constraint starts where `begin` does
    (tool_choice "auto" with strict tools); else the output starts with `begin`."""

    begin: str
    schema: dict
    end: str
    separator: str | None = None
    triggered: bool = False

    def __post_init__(self) -> None:
        for name in ("begin", "end"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"structural.{name} must be a string")
        if self.separator is not None and not isinstance(self.separator, str):
            raise ValueError("structural.separator must be a string or None")
        if not isinstance(self.schema, dict):
            raise ValueError("structural.schema must be a JSON Schema object")
        json_depth.check_value(self.schema, "structured_outputs.structural.schema")
        if self.triggered and not self.begin:
            raise ValueError("structural.begin must not be empty when triggered")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One of `json`, `json_object`, `regex`, `choice`, `structural`, `grammar` (see the
    module doc)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    structural: Structural | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice takes at most {MAX_CHOICES} "
                                 f"strings, got {len(self.choice)}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be true or false")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if isinstance(self.json, str):
            json_depth.check_text(self.json, "structured_outputs.json")
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON Schema (an object)")
        json_depth.check_value(self.json, "structured_outputs.json")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string (a Lark grammar)")
        if self.structural is not None and not isinstance(self.structural, Structural):
            raise ValueError("structured_outputs.structural must be a Structural")
        if len(self.key()) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs: the constraint is longer than "
                             f"{MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint (what compiled grammars are cached by)."""
        value = getattr(self, self.kind)
        if isinstance(value, Structural):
            value = [value.begin, value.schema, value.end, value.separator, value.triggered]
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))
