"""How deep JSON may nest: one bound, `MAX_DEPTH` objects and arrays inside one another, for
request bodies, JSON Schemas (`response_format`, `structured_outputs.json`, tool parameters)
and tool arguments, checked before anything recurses into them.

Python's `json` (parsing and writing), pydantic, Jinja's `tojson`, the schema walkers and
llguidance's own parser all recurse once per level; past about a thousand levels Python raises
RecursionError, and llguidance refuses a grammar past 128. So a text is scanned without
recursion before it is parsed (`text_depth`: strings skipped, brackets counted, at the speed
of `re` and `itertools`), and a value before it is walked (`check_value`: an explicit stack).
Beyond the bound: `NestedTooDeep`, a `ValueError` whose message starts with the path of the
first value nested too deep (`tools[0].function.parameters.properties.a...`); its `field` is
the path's first name, the field a 400 names.

Depth: a scalar is 0 deep, `[]` and `{}` 1, `{"a": [1]}` 2.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

MAX_DEPTH = 64  # objects and arrays inside one another, in a body, a schema, tool arguments
PATH_PARTS = 6  # components of a path shown before "..."
WINDOW = 1 << 16  # characters scanned in one call (a few ms with the GIL held)

_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OTHER_BYTES = re.compile(rb"[^\[\]{}]+")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OTHER = re.compile(r"[^\[\]{}]+")
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]', re.DOTALL)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_STEP_BYTES = [_STEP.get(b, 0) for b in range(256)]
_STEP_CHARS = {"[": 1, "{": 1, "]": -1, "}": -1}
_NAME = re.compile(r"[A-Za-z0-9_$-]+")


class NestedTooDeep(ValueError):
    """JSON nested deeper than the bound; `field`: the first name of the path to it."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def text_depth(text: str | bytes, window: int = WINDOW) -> int:
    """How deep the JSON text nests (its deepest point; strings do not count). Meant for valid
    JSON; for a malformed text it is a bound a parser would not go past by much.

    Scanned `window` characters at a time (`re` and `accumulate` hold the GIL for a whole
    call: 0.19 s for a 4 MB body, a stall of the event loop beside the thread that scans), each
    window ending outside a string: where a string runs past its end (a quote is left after
    the complete strings are cut out), the window grows until it closes."""
    if isinstance(text, (bytes, bytearray)):
        string, other, steps, quote = _STRING_BYTES, _OTHER_BYTES, _STEP_BYTES, b'"'
    else:
        string, other, steps, quote = _STRING, _OTHER, _STEP_CHARS, '"'
    deepest = depth = pos = 0
    while pos < len(text):
        size = window
        while True:
            stripped = string.sub(quote[:0], text[pos:pos + size])
            if quote not in stripped or pos + size >= len(text):
                break
            size *= 2  # a string runs past the window's end
        brackets = other.sub(quote[:0], stripped)
        levels = list(accumulate(map(steps.__getitem__, brackets), initial=depth))
        deepest, depth = max(deepest, *levels), levels[-1]
        pos += size
    return deepest


def check_text(text: str | bytes, field: str, limit: int = MAX_DEPTH) -> None:
    """ValueError naming the path of the first value nested deeper than `limit` in the JSON
    `text` (a path under `field`; "" for a whole body)."""
    if text_depth(text) > limit:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "replace")
        raise _too_deep(field, _text_path(text, limit), limit)


def check_value(value: object, field: str, limit: int = MAX_DEPTH) -> None:
    """ValueError naming the path of the first dict or list nested deeper than `limit` in
    `value` (walked with a stack of its own: a value that contains itself is refused too)."""
    path = _value_path(value, limit)
    if path is not None:
        raise _too_deep(field, path, limit)


def loads(text: str | bytes, field: str, limit: int = MAX_DEPTH) -> object:
    """`json.loads(text)` once `check_text` passed (ValueError for malformed JSON, as
    `json.loads` raises)."""
    check_text(text, field, limit)
    return json.loads(text)


def _too_deep(field: str, path: list[object], limit: int) -> NestedTooDeep:
    where = _render(field, path)
    first = re.match(r"[A-Za-z_][A-Za-z0-9_]*", where)
    return NestedTooDeep(f"{where or 'the body'}: JSON nested more than {limit} levels deep "
                         f"(objects and arrays inside one another); this server takes at most "
                         f"{limit}", first.group() if first else None)


def _render(field: str, path: list[object]) -> str:
    parts = []
    for part in path[:PATH_PARTS]:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif _NAME.fullmatch(part):
            parts.append(f".{part}")
        else:
            parts.append(f"[{json.dumps(part)}]")
    text = field + "".join(parts)
    text = text[1:] if text.startswith(".") else text
    return text + ("..." if len(path) > PATH_PARTS else "")


def _text_path(text: str, limit: int) -> list[object]:
    """The keys and indices leading to the first container nested deeper than `limit`."""
    frames: list[list] = []  # per open container: [is_object, its current key or index]
    key: str | None = None
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token in "[{":
            if len(frames) == limit:
                return [f[1] for f in frames]
            frames.append([token == "{", None if token == "{" else 0])
        elif token in "]}":
            if frames:
                frames.pop()
        elif token == ",":
            if frames and not frames[-1][0]:
                frames[-1][1] += 1
        elif token == ":":
            if frames and frames[-1][0]:
                frames[-1][1] = key
        else:  # a string: a key when a colon follows
            try:
                key = json.loads(token)
            except ValueError:
                key = token[1:-1]
    return [f[1] for f in frames]


def _value_path(value: object, limit: int) -> list[object] | None:
    if not isinstance(value, (dict, list, tuple)):
        return None
    stack = [_children(value)]
    names: list[object] = []  # names[i]: the key in stack[i] of the child stack[i + 1] walks
    while stack:
        for name, child in stack[-1]:
            if isinstance(child, (dict, list, tuple)):
                if len(stack) >= limit:
                    return names + [name]
                names.append(name)
                stack.append(_children(child))
                break
        else:
            stack.pop()
            if names:
                names.pop()
    return None


def _children(value):
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)
