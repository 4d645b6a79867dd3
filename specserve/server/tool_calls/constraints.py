"""What a request's output is held to: its `StructuredOutputsParams`, from `tool_choice`,
`response_format` and vLLM's `structured_outputs`.

- `tool_choice` "required" or a named function: the output is calls in the model's own
  syntax (`Structural`, not triggered), each `{"name": <const>, <arguments key>: <the
  function's parameters>}` (anyOf over the functions allowed); one call only where
  `parallel_tool_calls` is false. This wins over `response_format` (the turn is a call).
- "auto" with a `strict` function: the same, triggered where the call's marker starts
  (free text before it); the functions not strict take any object. Formats with no marker
  (`llama3_json`) get none. `response_format` or `structured_outputs` win over it (as in
  vLLM, whose grammar then holds the whole output).
- `response_format` json_object / json_schema: `json_object=True` / `json=<schema>`.
- `strict: true` (a json_schema response format, a function) means OpenAI's strict mode: an
  object schema that does not say otherwise takes no properties beyond its own
  (`additionalProperties: false`, as OpenAI requires of strict schemas and xgrammar's strict
  mode assumes).
- `structured_outputs`: as given (not together with `response_format`, nor with calls
  required).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.sampling.structured import Structural, StructuredOutputsParams
from specserve.server.tool_calls.families import ToolFormat

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str  # the request field it comes from, for errors


def chat_constraint(req, fmt: ToolFormat, choice) -> Constraint | None:
    """The constraint of a chat request (`choice`: its tool_choice, "none" without tools)."""
    given = _given(req)
    if choice not in ("none", "auto"):
        if req.structured_outputs is not None:
            raise ValueError("structured_outputs cannot be combined with tool_choice "
                             "'required' or a named function (the output is tool calls)")
        return Constraint(_tools(req, fmt, choice), "tools")
    if given is not None:
        return given
    if choice == "auto" and fmt.begin and any(t.function.strict for t in req.tools):
        return Constraint(_tools(req, fmt, choice), "tools")
    return None


def completion_constraint(req) -> Constraint | None:
    return _given(req)


def _given(req) -> Constraint | None:
    fmt = req.response_format
    so = req.structured_outputs
    if so is not None and fmt is not None and fmt.type != "text":
        raise ValueError("structured_outputs cannot be combined with response_format; give one")
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "json_object": bool(so.json_object),
                  "choice": tuple(so.choice) if so.choice is not None else None}
        return Constraint(StructuredOutputsParams(**fields), "structured_outputs")
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.json_schema if fmt.type == "json_schema" else None
    if schema is not None and fmt.json_schema.strict:
        schema = strict_schema(schema)
    params = (StructuredOutputsParams(json=schema) if schema is not None
              else StructuredOutputsParams(json_object=True))
    return Constraint(params, "response_format")


def _tools(req, fmt: ToolFormat, choice) -> StructuredOutputsParams:
    triggered = choice == "auto"
    functions = [t.function for t in req.tools]
    if not isinstance(choice, str):
        functions = [f for f in functions if f.name == choice.function.name]
    schemas = [call_schema(f.name, fmt.arguments_key,
                           (strict_schema(f.parameters) if f.strict and f.parameters
                            else f.parameters) if (f.strict or not triggered) else None)
               for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    separator = fmt.separator if req.parallel_tool_calls is not False else None
    return StructuredOutputsParams(structural=Structural(
        fmt.begin, schema, fmt.end, separator or None, triggered))


def call_schema(name: str, arguments_key: str, parameters: dict | None) -> dict:
    """One call: its name, then its arguments (any object where `parameters` is None)."""
    return {"type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters or ANY_OBJECT},
            "required": ["name", arguments_key], "additionalProperties": False}


def strict_schema(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object schema that sets neither it
    nor `patternProperties` (OpenAI's strict mode), through every nested schema."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
