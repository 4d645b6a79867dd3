"""A `POST /v1/responses` body (OpenAI's Responses API) and its conversion into the chat request.

What a stateless server can honour, as OpenAI documents it:
- `input` (a string, or items: messages with text parts; `function_call` and
  `function_call_output`; `custom_tool_call` and `custom_tool_call_output`; `reasoning` items
  are skipped, this server writes none), `instructions` (a system message before the input);
- `tools`: `function` tools; `custom` tools (freeform text: shown as a function of one string
  `input`, answered as `custom_tool_call`); `namespace` groups (their tools flattened, calls
  carry the namespace back); hosted tools (`web_search`, `file_search`, `mcp`, ...) are left
  out: nothing here runs them. `tool_choice` (auto, none, required, a function, `allowed_tools`),
  `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
  `max_output_tokens` (bounded by the room left in the context), `temperature`, `top_p`;
- `store` is never honoured as storage: nothing is kept (`store: false` is what it asks);
  `previous_response_id`, `conversation`, `prompt` and `background` need state this server
  does not keep: a 400 saying so (send the whole conversation in `input`).
Other fields OpenAI documents (`include`, `reasoning`, `metadata`, `truncation`, ...) and fields
unknown to this server are ignored, as vLLM and llama.cpp do, so that a newer client still
connects. Ours: `speculative`, `seed`, `top_k`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from specserve.server.protocol import MAX_TOOLS, Seed, SpeculativeOptions


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Open(BaseModel):
    """An item or part checked by the conversion, which names what it cannot take."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class ContentPart(_Open):
    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(_Open):
    type: str = "message"  # an easy input message may leave it out
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None
    output: str | list[ContentPart] | None = None


class ToolDef(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ToolDef] | None = None  # a namespace's


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    model: str
    input: Union[str, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: str | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    # ours
    speculative: bool | SpeculativeOptions | None = None
    seed: Seed | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None


@dataclass
class ToolNames:
    """What the chat functions stand for: a custom tool's name (its calls are
    `custom_tool_call`s) or a namespace's tool (its calls carry the namespace)."""

    custom: set[str] = field(default_factory=set)
    namespace: dict[str, str] = field(default_factory=dict)  # function name -> its namespace


TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
STATEFUL = {"previous_response_id": "a response stored by an earlier call",
            "conversation": "a stored conversation", "prompt": "a stored prompt template",
            "background": "a response run in the background and fetched later"}
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}},
                "required": ["input"], "additionalProperties": False}


def chat_body(req: ResponsesRequest) -> tuple[dict, ToolNames]:
    """The chat request `req` stands for, as a JSON body, and what its functions stand for.
    ValueError naming the field where something cannot be served."""
    for name, what in STATEFUL.items():
        if getattr(req, name) not in (None, False):
            raise ValueError(f"{name}: this server keeps no state between calls ({what}); "
                             f"send the whole conversation in `input`")
    names = ToolNames()
    tools = _tools(req.tools or [], names)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, f"input[{i}]")
    body: dict = {"model": req.model, "messages": messages}
    if tools:
        body["tools"] = tools
        if req.tool_choice is not None:
            body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    elif req.tool_choice not in (None, "auto", "none"):
        raise ValueError("tool_choice asks for tool calls, but the request gives no function "
                         "tools")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.json_schema, "strict": fmt.strict}}
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("seed", req.seed), ("top_k", req.top_k),
                        ("speculative", _plain(req.speculative))):
        if value is not None:
            body[name] = value
    return body, names


def _tools(tools: list[ToolDef], names: ToolNames, namespace: str | None = None) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]" if namespace is None else f"tools[{namespace}].tools[{i}]"
        if tool.type == "namespace" and namespace is None:
            if not tool.name:
                raise ValueError(f"{where}.name: a namespace needs a name")
            out += _tools(tool.tools or [], names, tool.name)
            continue
        if tool.type not in ("function", "custom"):
            continue  # hosted tools: nothing here runs them
        if not tool.name:
            raise ValueError(f"{where}.name: a {tool.type} tool needs a name")
        function = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.type == "custom":
            names.custom.add(tool.name)
            function["parameters"] = CUSTOM_INPUT
        elif tool.parameters is not None:
            function["parameters"] = tool.parameters
            if tool.strict:
                function["strict"] = True
        if namespace is not None:
            names.namespace[tool.name] = namespace
        out.append({"type": "function", "function": function})
    if len(out) > MAX_TOOLS:
        raise ValueError(f"tools: {len(out)} function and custom tools; this server takes at "
                         f"most {MAX_TOOLS}")
    return out


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        listed = [t.get("name") for t in choice["tools"] if isinstance(t, dict)]
        return {"type": "allowed_tools", "allowed_tools": {
            "mode": choice.get("mode", "auto"),
            "tools": [{"type": "function", "function": {"name": n}} for n in listed]}}
    raise ValueError(f"tool_choice: {json.dumps(choice)[:80]} is not one this server can "
                     f"honour (auto, none, required, a function or custom tool, allowed_tools)")


def _add_item(messages: list[dict], item: InputItem, where: str) -> None:
    if item.type == "message":
        role = item.role if item.role != "developer" else "system"
        if role not in ("user", "assistant", "system"):
            raise ValueError(f"{where}.role: expected user, assistant, system or developer, "
                             f"got {item.role!r}")
        messages.append({"role": role, "content": _text(item.content, f"{where}.content")})
    elif item.type in ("function_call", "custom_tool_call"):
        arguments = item.arguments if item.type == "function_call" else json.dumps(
            {"input": item.input or ""}, ensure_ascii=False)
        if not item.call_id or not item.name or arguments is None:
            raise ValueError(f"{where}: a {item.type} needs call_id, name and its "
                             f"{'arguments' if item.type == 'function_call' else 'input'}")
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type in ("function_call_output", "custom_tool_call_output"):
        if not item.call_id or item.output is None:
            raise ValueError(f"{where}: a {item.type} needs call_id and output")
        messages.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": _text(item.output, f"{where}.output")})
    elif item.type != "reasoning":
        raise ValueError(f"{where}.type: {item.type!r} items are not supported by this server "
                         f"(messages, function and custom tool calls and their outputs are)")


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type in TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise ValueError(f"{where}[{i}]: {part.type!r} content is not supported by this "
                             f"model (text only)")
    return "\n".join(texts)


def _plain(value: object) -> object:
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
