"""What a request's output is held to: its `StructuredOutputsParams`, from `tool_choice`,
`response_format` and vLLM's `structured_outputs`.

- `tool_choice` "required" or a named function: the output is calls in the model's own
  syntax, each to one of the functions allowed with arguments valid against its parameters
  (`call_grammar.py`); one call only where `parallel_tool_calls` is false. This wins over
  `response_format` (the turn is a call).
- "auto" (the default with tools): free text, and once the model starts a call in any form its
  parser reads (its marker, a ```json fence, a bare `{"name": `), the rest of the call is held
  to a declared function and its schema. `response_format` or `structured_outputs` win over it
  (as in vLLM, whose grammar then holds the whole output).
- `allowed_tools` (OpenAI's): as "auto" or "required", with calls held to the functions it
  lists (every tool is still shown to the model).
- `response_format` json_object / json_schema: `json_object=True` / `json=<schema>`.
- JSON Schemas are closed wherever they come from (`grammar_source.closed_schema`: an object
  schema that does not say otherwise takes no other keys), strict or not; a tool's schema not
  marked strict is enforced leniently (keywords the engine cannot enforce are skipped), a
  strict one or a response format's is refused where it cannot be enforced.
- `structured_outputs`: as given (not together with `response_format`, nor with calls
  required).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.sampling.structured import StructuredOutputsParams
from specserve.server.tool_calls.call_grammar import Function, tool_call_grammar
from specserve.server.tool_calls.families import ToolFormat


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str  # the request field it comes from, for errors


def chat_constraint(req, fmt: ToolFormat, choice) -> Constraint | None:
    """The constraint of a chat request (`choice`: its tool_choice, "none" without tools)."""
    given = _given(req)
    if choice == "none":
        return given
    if calls_required(choice):
        if req.structured_outputs is not None:
            raise ValueError("structured_outputs cannot be combined with tool_choice "
                             "'required' or a named function (the output is tool calls)")
        return Constraint(_tools(req, fmt, choice), "tools")
    if given is not None:
        return given
    return Constraint(_tools(req, fmt, choice), "tools")


def completion_constraint(req) -> Constraint | None:
    return _given(req)


def calls_required(choice) -> bool:
    """Whether a tool_choice asks for calls: "required", a named function, or allowed tools in
    "required" mode."""
    if isinstance(choice, str):
        return choice == "required"
    return choice.type == "function" or choice.allowed_tools.mode == "required"


def allowed_names(req, choice) -> list[str]:
    """The functions a call may name under `choice` (every tool's unless it narrows them)."""
    names = [t.function.name for t in req.tools]
    if isinstance(choice, str):
        return names
    if choice.type == "function":
        return [choice.function.name]
    listed = {t.function.name for t in choice.allowed_tools.tools}
    return [name for name in names if name in listed]


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
    if fmt.type == "json_schema" and fmt.json_schema.json_schema is not None:
        return Constraint(StructuredOutputsParams(json=fmt.json_schema.json_schema),
                          "response_format")
    return Constraint(StructuredOutputsParams(json_object=True), "response_format")


def _tools(req, fmt: ToolFormat, choice) -> StructuredOutputsParams:
    allowed = set(allowed_names(req, choice))
    functions = [Function(t.function.name, t.function.parameters, bool(t.function.strict))
                 for t in req.tools if t.function.name in allowed]
    grammar = tool_call_grammar(functions, fmt, required=calls_required(choice),
                                parallel=req.parallel_tool_calls is not False)
    return StructuredOutputsParams(grammar=grammar)
