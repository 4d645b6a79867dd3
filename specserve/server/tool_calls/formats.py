"""Tool-call formats: how each model family writes calls, read back by a parser per family.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call; also a call in a ```json fence, or a bare call object
  opening the output (small Qwen2.5-Coder models answer so), as llama.cpp reads them.
- `llama3_json` (Llama 3.x): the output opens with `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` where the detokenizer keeps it), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`; the marker is a
  control token the detokenizer drops, so an array of calls opening the output counts too.
- `generic` (templates with no tool syntax, e.g. Gemma 3): the output is one JSON object,
  `{"tool_calls": [{"name", "arguments"}, ...]}` or `{"response": "..."}` (its text is the
  content), possibly in a ```json fence; anything else is content.

A call is committed as soon as its head `{"name": "<name>", "arguments": {` is read, its name
one the request declares (its arguments then stream as the model writes them, as written); a
call object in another key order or with string arguments is read whole, then committed;
whatever is neither stays content, its markup included. A committed call whose arguments stop
being JSON, or are cut by the end of the output, is reported `cut` from where its block
began (`reader.py`).
"""

from __future__ import annotations

import json

from specserve.server.tool_calls.json_scan import JsonScan
from specserve.server.tool_calls.reader import Reader

ARGUMENTS = ('"arguments"',)
PARAMETERS = ('"parameters"', '"arguments"')


def hermes(r: Reader):
    yield from leading_call(r, ARGUMENTS)
    while True:
        opener = yield from r.content_until(("<tool_call>", "```"))
        if opener is None:
            return
        at = r.pos
        r.pos += len(opener)
        if opener == "```":
            yield from r.literal("json")
        yield from r.ws()
        if (yield from read_call(r, ARGUMENTS, at)):
            yield from r.ws()
            yield from r.literal("</tool_call>" if opener == "<tool_call>" else "```")
        else:
            r.pos = at + len(opener)
            r.content(opener)


def llama3_json(r: Reader):
    start = r.pos
    yield from r.ws()
    yield from r.literal("<|python_tag|>")
    made = False
    while True:
        yield from r.ws()
        at = r.pos
        if (yield from r.peek()) != "{" or not (yield from read_call(r, PARAMETERS)):
            r.pos = at
            break
        made = True
        yield from r.ws()
        yield from r.literal(";")
    if not made:
        r.pos = start
    yield from r.content_until(())


def mistral(r: Reader):
    start = r.pos
    yield from r.ws()
    if not (yield from call_list(r, ARGUMENTS)):
        r.pos = start
    while True:
        opener = yield from r.content_until(("[TOOL_CALLS]",))
        if opener is None:
            return
        at = r.pos
        r.pos += len(opener)
        yield from r.ws()
        if not (yield from call_list(r, ARGUMENTS)):
            r.pos = at + len(opener)
            r.content(opener)


def generic(r: Reader):
    start = r.pos
    yield from r.ws()
    fenced = yield from r.literal("```")
    if fenced:
        yield from r.literal("json")
        yield from r.ws()
    if not (yield from _generic_answer(r)):
        r.pos = start
    elif fenced:
        yield from r.ws()
        yield from r.literal("```")
    yield from r.content_until(())


def _generic_answer(r: Reader):
    at = r.pos
    if not (yield from r.literal("{")):
        return False
    yield from r.ws()
    key = yield from r.one_of(('"tool_calls"', '"response"', '"name"'))
    if key == '"name"':
        r.pos = at
        return (yield from read_call(r, ARGUMENTS))
    if key is None:
        return False
    yield from r.ws()
    if not (yield from r.literal(":")):
        return False
    yield from r.ws()
    if key == '"tool_calls"':
        if not (yield from call_list(r, ARGUMENTS)):
            return False
    elif (yield from r.peek()) != '"':
        return False
    else:
        yield from r.stream_string(r.content)
    yield from r.stream_value(_ignore, JsonScan(depth=1))  # the rest of the object
    return True


# ---------------------------------------------------------------------------- calls
def leading_call(r: Reader, keys: tuple[str, ...]):
    """A call object opening the output (whitespace before it aside)."""
    start = r.pos
    yield from r.ws()
    if (yield from r.peek()) == "{" and (yield from read_call(r, keys)):
        return True
    r.pos = start
    return False


def call_list(r: Reader, keys: tuple[str, ...]):
    """`[` call (`,` call)* `]`. False (nothing consumed) unless its first call is one; a
    later item that is not a call ends the list there (the rest is content)."""
    start = r.pos
    if not (yield from r.literal("[")):
        return False
    made = False
    while True:
        yield from r.ws()
        at = r.pos
        if not (yield from read_call(r, keys)):
            r.pos = at if made else start
            return made
        made = True
        yield from r.ws()
        if not (yield from r.literal(",")):
            yield from r.literal("]")
            return True


def read_call(r: Reader, keys: tuple[str, ...], block: int | None = None):
    """One call object at `pos` (its block, markup included, from `block`; None: from the
    object): True (and its events emitted) or False (`pos` unmoved)."""
    start = r.pos
    name = yield from _head(r, keys)
    if name is not None:
        index = r.call(name)
        if (yield from r.stream_value(lambda text: r.args(index, text))):
            r.ended(index)
            yield from r.stream_value(_ignore, JsonScan(depth=1))  # the rest of the call
        else:
            r.cut(index, start if block is None else block)
        return True
    r.pos = start
    end = yield from r.value_end()
    call = None if end is None else whole_call(r.text[start:end], keys)
    if call is not None and not r.declared(call[0]):
        call = None
    if call is None:
        r.pos = start
        return False
    r.pos = end
    index = r.call(call[0])
    r.args(index, call[1])
    r.ended(index)
    return True


def _head(r: Reader, keys: tuple[str, ...]):
    """The name of a call whose text reads `{"name": "<name>", "<key>": {`, `pos` at that
    last brace; None (`pos` anywhere) once the text is not such a head."""
    for lit in ("{", '"name"', ":"):
        yield from r.ws()
        if not (yield from r.literal(lit)):
            return None
    yield from r.ws()
    if (yield from r.peek()) != '"':
        return None
    end = yield from r.value_end()
    name = None if end is None else _json(r.text[r.pos:end])
    if not r.declared(name):
        return None
    r.pos = end
    yield from r.ws()
    if not (yield from r.literal(",")):
        return None
    yield from r.ws()
    if (yield from r.one_of(keys)) is None:
        return None
    yield from r.ws()
    if not (yield from r.literal(":")):
        return None
    yield from r.ws()
    return name if (yield from r.peek()) == "{" else None


def whole_call(text: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call object; None if it is not one."""
    value = _json(text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k.strip('"') for k in keys if k.strip('"') in value), None)
    if key is None:  # e.g. a package.json: {"name": ..., "version": ...}
        return None
    arguments = value[key]
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _json(text: str) -> object:
    """The value of a JSON text; None where it is not JSON or holds no valid Unicode."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return None
    return value


def _ignore(text: str) -> None:
    pass
