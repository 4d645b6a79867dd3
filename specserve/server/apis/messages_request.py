"""A `POST /v1/messages` body (the Anthropic Messages API) and its conversion into the chat
request; `/v1/messages/count_tokens` takes the same body without `max_tokens`.

As Anthropic documents it: `system` (a string or text blocks), `messages` (user and assistant
turns of text blocks; `tool_use` blocks in assistant turns, `tool_result` blocks in user turns,
their content text; a `system` turn in the list is a system message where it stands),
`tools` (custom tools with an `input_schema`; Anthropic's own server and client tools, e.g.
`web_search_...`, are left out: nothing here runs them), `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), `stop_sequences`, `max_tokens` (bounded by the room left in the
context), `temperature`, `top_p`, `top_k`, `stream`, and `output_format` (a JSON schema).
`thinking` and `redacted_thinking` blocks a client sends back are accepted and left out of the
prompt (this server writes none); images and documents are refused (text only). `metadata`,
`thinking`, `service_tier`, `context_management`, `output_config` and fields unknown to this
server are ignored, so a newer client still connects. Ours: `speculative`, `seed`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling.params import MAX_STOP_STRINGS
from specserve.server.protocol import MAX_TOOLS, Seed, SpeculativeOptions


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class Block(BaseModel):
    """A content block, checked by the conversion, which names what it cannot take."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Wire):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Wire):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class CountTokensRequest(_Wire):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Union[str, list[Block], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]],
                              Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    output_format: OutputFormat | None = None
    # ours
    speculative: bool | SpeculativeOptions | None = None
    seed: Seed | None = None


CUSTOM_TOOL_TYPES = (None, "custom")
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


def chat_body(req: CountTokensRequest) -> dict:
    """The chat request `req` stands for, as a JSON body. ValueError naming the field where
    something cannot be served."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        _add_message(messages, message, f"messages[{i}]")
    body: dict = {"model": req.model, "messages": messages}
    tools = [{"type": "function", "function": _function(t)} for t in req.tools or ()
             if t.type in CUSTOM_TOOL_TYPES]
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools; this server takes at most {MAX_TOOLS}")
    choice = req.tool_choice
    if tools:
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = _tool_choice(choice)
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    elif choice is not None and choice.type in ("any", "tool"):
        raise ValueError("tool_choice asks for a tool call, but the request gives no custom tools")
    if isinstance(req, MessagesRequest):
        _sampling(body, req)
    return body


def _sampling(body: dict, req: MessagesRequest) -> None:
    body["max_tokens"] = req.max_tokens
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("top_k", req.top_k), ("seed", req.seed)):
        if value is not None:
            body[name] = value
    if req.speculative is not None:
        spec = req.speculative
        body["speculative"] = spec.model_dump(exclude_none=True) if isinstance(
            spec, BaseModel) else spec
    if req.output_format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_format.json_schema}}


def _function(tool: Tool) -> dict:
    function: dict = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    if tool.strict:
        function["strict"] = True
    return function


def _tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice.name: a tool_choice of type 'tool' names the tool")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _add_message(messages: list[dict], message: Message, where: str) -> None:
    blocks = ([Block(type="text", text=message.content)] if isinstance(message.content, str)
              else message.content)
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name or not isinstance(block.input, dict):
                raise ValueError(f"{at}: a tool_use block needs id, name and an input object")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise ValueError(f"{at}.tool_use_id: a tool_result names the tool_use it answers")
            result = _text(block.content or "", f"{at}.content")
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {result}" if block.is_error else result})
        elif block.type not in SKIPPED_BLOCKS:
            raise ValueError(f"{at}: {block.type!r} blocks are not supported in {message.role} "
                             f"messages by this server (text, tool_use, tool_result are)")
    if texts or calls:
        entry: dict = {"role": message.role, "content": "\n".join(texts) if texts else None}
        if calls:
            entry["tool_calls"] = calls
        elif entry["content"] is None:
            entry["content"] = ""
        messages.append(entry)


def _text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise ValueError(f"{where}[{i}]: {block.type!r} content is not supported by this "
                             f"model (text only)")
        texts.append(block.text)
    return "\n".join(texts)
