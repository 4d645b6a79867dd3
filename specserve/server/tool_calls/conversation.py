"""A chat request's conversation and tools as its model's chat template takes them.

Native formats: the messages in OpenAI's shape (assistant `tool_calls`, `tool` messages) and
`tools=` the OpenAI tool list, as Hugging Face templates expect; for `mistral`, call ids
become the 9 letters and digits its templates insist on (the same id, the same 9).
`generic`: the tools are described in a system prompt of ours (appended to the client's first
system message, or put before the first user message where the template shows no system
prompt), earlier calls are the JSON object the model was told to write and tool results are
user text (consecutive user turns joined, for templates that insist turns alternate).
With tool_choice "none" a native template still gets the tools (vLLM's default; no call is
parsed), the generic prompt is left out (it asks for calls nobody would read).

Checks a client can fail (`ValueError`s naming the field): a `tool` message answering no call
made before it, a tool name given twice, `tool_choice` naming a function not in `tools` or
asking for calls without `tools`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from specserve.server.tool_calls.families import MISTRAL, ToolFormat

GENERIC_PROMPT = (
    "You can call tools. Each tool below is a JSON object with its name, its description and "
    "the JSON Schema of its arguments:\n{tools}\n\n"
    "To call tools, answer with only this JSON object, one entry per call:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}\n'
    "To answer without calling a tool, answer with only this JSON object:\n"
    '{{"response": "<your answer>"}}')


@dataclass(frozen=True)
class TemplateInputs:
    messages: list[dict]
    tools: list[dict] | None  # for the template's `tools` (None: not given to it)


def template_inputs(req, fmt: ToolFormat, system_shown: bool) -> TemplateInputs:
    """What `req` (a ChatCompletionRequest) is rendered with, its tool fields checked."""
    messages = [_message(m) for m in req.messages]
    _check_results(messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    check_tool_choice(req.tool_choice, tools)
    shown = tools if choice_of(req) != "none" or fmt.native else None
    if fmt.native:
        if fmt is MISTRAL:
            messages = _short_ids(messages)
        return TemplateInputs(messages, shown)
    messages = _generic_history(messages)
    if shown:
        messages = _with_tool_prompt(messages, GENERIC_PROMPT.format(tools=_tool_lines(shown)),
                                     system_shown)
    return TemplateInputs(messages, None)


def choice_of(req) -> str | object:
    """The request's tool_choice: "none" without tools, "auto" with them unless given."""
    if not req.tools:
        return "none"
    return req.tool_choice if req.tool_choice is not None else "auto"


def check_tool_choice(choice, tools: list[dict] | None) -> None:
    names = [t["function"]["name"] for t in tools or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: each function needs its own name; {twice[0]!r} is given twice")
    if choice is None or choice in ("none", "auto"):
        return
    if not tools:
        raise ValueError(f"tool_choice {_choice_text(choice)} asks for tool calls, but the "
                         f"request gives no tools")
    if isinstance(choice, str):
        return
    named = [choice.function] if choice.type == "function" else [
        t.function for t in choice.allowed_tools.tools]
    for function in named:
        if function.name not in names:
            raise ValueError(f"tool_choice names the function {function.name!r}, which is "
                             f"not among the tools ({', '.join(names)})")


def _choice_text(choice) -> str:
    if isinstance(choice, str):
        return repr(choice)
    if choice.type == "function":
        return f"function {choice.function.name!r}"
    return f"allowed_tools ({choice.allowed_tools.mode})"


def _message(m) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls is not None:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _check_results(messages: list[dict]) -> None:
    made: dict[str, str] = {}
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            made[call["id"]] = call["function"]["name"]
        if m["role"] == "tool" and m["tool_call_id"] not in made:
            raise ValueError(f"messages[{i}].tool_call_id {m['tool_call_id']!r} answers no tool "
                             f"call of an earlier assistant message")


def _short_ids(messages: list[dict]) -> list[dict]:
    def short(call_id: str) -> str:
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "id": short(c["id"])} for c in m["tool_calls"]]
        if "tool_call_id" in m:
            m["tool_call_id"] = short(m["tool_call_id"])
        out.append(m)
    return out


def _generic_history(messages: list[dict]) -> list[dict]:
    """Calls as the JSON object the model writes them in, results as user text."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    from_tool: list[bool] = []  # whether out[i] holds a tool result
    for m in messages:
        tool = m["role"] == "tool"
        if "tool_calls" in m:
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c)}
                     for c in m["tool_calls"]]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            text = f"{m['content']}\n\n{text}" if m["content"] else text
            m = {"role": "assistant", "content": text}
        elif tool:
            result = {"name": names[m["tool_call_id"]], "content": m["content"]}
            m = {"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)}
        if out and m["role"] == out[-1]["role"] == "user" and (tool or from_tool[-1]):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
            from_tool[-1] = True
        else:
            out.append(m)
            from_tool.append(tool)
    return out


def _arguments(call: dict) -> object:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps({k: v for k, v in t["function"].items() if k != "strict"},
                                ensure_ascii=False) for t in tools)


def _with_tool_prompt(messages: list[dict], prompt: str, system_shown: bool) -> list[dict]:
    first = messages[0]
    if system_shown and first["role"] == "system":
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}] + messages[1:]
    if system_shown:
        return [{"role": "system", "content": prompt}] + messages
    i = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if i is None:
        raise ValueError("tools: this model's chat template shows no system prompt and the "
                         "conversation has no user message to describe the tools in")
    return messages[:i] + [{**messages[i], "content": f"{prompt}\n\n{messages[i]['content']}"}] \
        + messages[i + 1:]
