"""Chat templates: checking a conversation (and its tools) before a template sees it, the Jinja
environment templates run in, and keeping client text as text through a template.

A conversation is a list of messages `{"role", "content", "name", "tool_calls",
"tool_call_id"}`; `tools` is the OpenAI tool list (`[{"type": "function", "function": {...}}]`)
that Hugging Face templates take as `tools`. An assistant message's `tool_calls` come in
OpenAI's shape, their `arguments` a JSON string; templates `tojson` them, so a string holding a
JSON object is handed to the template as that object (as vLLM does).

`ClientText` keeps every string a client wrote (contents, names, tool definitions, arguments,
ids) as text: before rendering, each message content is replaced by a placeholder and every
special token's text elsewhere by another; the rendered text is then split at the
placeholders, so that only the template's own text can hold control tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve import json_depth

BASE_ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def check_text(field: str, text: object) -> str:
    """Return `text` if it is a string of valid Unicode; a lone surrogate is a ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a string, got {type(text).__name__}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} contains a lone surrogate {text[e.start]!r} at index "
                             f"{e.start}; text must be valid Unicode") from None
    return text


def check_messages(messages: object, roles: tuple[str, ...]) -> list[dict]:
    """Validate one conversation; return it with content-part lists joined into strings and
    tool-call arguments that hold a JSON object parsed into it.

    Each message is a dict with a `role` from `roles` and a `content` that is a string or a
    list of `{"type": "text", "text": ...}` parts; an assistant message that carries
    `tool_calls` may have null content (handed to the template as "").
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    return [_check_message(i, m, roles) for i, m in enumerate(messages)]


def _check_message(i: int, message: object, roles: tuple[str, ...]) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {message!r}")
    unknown = [k for k in message if k not in MESSAGE_KEYS]
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; known: {list(MESSAGE_KEYS)}")
    if "role" not in message:
        raise ValueError(f"{where}.role is missing (one of {', '.join(roles)})")
    role = message["role"]
    if not isinstance(role, str) or role not in roles:
        raise ValueError(f"{where}.role must be one of {', '.join(roles)} for this model's "
                         f"chat template, got {role!r}")
    checked = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
        checked["tool_calls"] = _check_tool_calls(f"{where}.tool_calls", message["tool_calls"])
        content = "" if content is None else content
    if content is None:
        raise ValueError(f"{where}.content is missing (a string or a list of text parts)")
    checked["content"] = _content_text(f"{where}.content", content)
    for key in ("name", "tool_call_id"):
        if key in checked:
            check_text(f"{where}.{key}", checked[key])
    return checked


def _check_tool_calls(where: str, calls: object) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls, got {calls!r}")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}] must be {{'id', 'type': 'function', 'function': "
                             f"{{'name', 'arguments'}}}}, got {call!r}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            json_depth.check_text(arguments, f"{where}[{j}].function.arguments")
            arguments = _json_object_or_text(arguments)
        json_depth.check_value(arguments, f"{where}[{j}].function.arguments")
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def _json_object_or_text(text: str) -> dict | str:
    """The object a JSON text holds; the text itself where it holds none (templates then
    show it as a string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _content_text(where: str, content: object) -> str:
    if isinstance(content, str):
        return check_text(where, content)
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where} must be a string or a non-empty list of text parts "
                         f"({{'type': 'text', 'text': ...}}), got {content!r}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text":
            raise ValueError(f"{where}[{j}] must be {{'type': 'text', 'text': ...}} (only text "
                             f"parts are supported), got {part!r}")
        texts.append(check_text(f"{where}[{j}].text", part["text"]))
    return "\n".join(texts)


def check_tools(tools: object) -> list[dict] | None:
    """The OpenAI tool list a template takes (None: no tools): each a dict
    `{"type": "function", "function": {"name": str, ...}}`, nested at most
    `json_depth.MAX_DEPTH` deep."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tool dicts, got {tools!r}")
    json_depth.check_value(tools, "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                             f"'description', 'parameters'}}}}, got {tool!r}")
    return tools


def strings(value: object):
    """Every string inside a JSON-like value (dict keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings(v)


class ClientText:
    """Placeholders that carry client strings through one rendering of a template.

    `mark` replaces each non-empty message content by `\\ue000<nonce>:<i>\\n\\ue001` and every
    special token's text in any other client string by `\\ue000<nonce>:s<j>\\ue001`; `split`
    cuts the rendered text into template text and client text. It returns None where the
    template changed a placeholder on its way through (content rendered other than once, a
    placeholder transformed, or a content escaped: the newline in its placeholder would not
    come through `tojson`), so that the caller can fall back. The special tokens' texts hold
    nothing JSON escapes, so theirs may pass through `tojson` (tool arguments do).
    """

    def __init__(self, specials: list[str]) -> None:
        self.specials = sorted((s for s in specials if s), key=len, reverse=True)
        self.nonce = secrets.token_hex(8)
        self._special_re = (re.compile("|".join(map(re.escape, self.specials)))
                            if self.specials else None)
        self._marked: list[int] = []

    def mark(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
        marked = []
        for i, m in enumerate(messages):
            copy = {k: self._special(v) for k, v in m.items() if k != "content"}
            content = m.get("content")
            if isinstance(content, str) and content:
                copy["content"] = f"\ue000{self.nonce}:{i}\n\ue001"
                self._marked.append(i)
            else:
                copy["content"] = content
            marked.append(copy)
        return marked, (None if tools is None else self._special(tools))

    def split(self, rendered: str, messages: list[dict]) -> list[tuple[str, bool]] | None:
        """(text, is_client_text) pieces of `rendered`, or None (see the class doc)."""
        parts = re.split(f"\ue000{self.nonce}:(\\d+\n|s\\d+)\ue001", rendered)
        contents = sorted(int(p) for p in parts[1::2] if p.endswith("\n"))
        if contents != self._marked or any(self.nonce in p for p in parts[::2]):
            return None
        pieces = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                pieces.append((part, False))
            elif part.startswith("s"):
                pieces.append((self.specials[int(part[1:])], True))
            else:
                pieces.append((messages[int(part)]["content"], True))
        return pieces

    def _special(self, value: object) -> object:
        if self._special_re is None:
            return value
        if isinstance(value, str):
            return self._special_re.sub(
                lambda m: f"\ue000{self.nonce}:s{self.specials.index(m.group())}\ue001", value)
        if isinstance(value, dict):
            return {self._special(k): self._special(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._special(v) for v in value]
        return value


def jinja_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
