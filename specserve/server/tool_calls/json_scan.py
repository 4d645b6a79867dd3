"""Reading JSON a piece at a time: where a value ends (`JsonScan`) and a string's decoded text
(`decode_string`), each resumable where the text so far ran out.

`JsonScan` tracks strings and brackets only; it does not check the value (`json.loads` does,
where it matters). Both work by characters, so a value cut anywhere reads the same.
"""

from __future__ import annotations

import re

ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
           "t": "\t"}
PRIMITIVE = frozenset("0123456789+-.eEtrufalsn")
# what may still become the low half of a surrogate pair: "\uDC00" to "\uDFFF", cut anywhere
_LOW_HALF_START = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class JsonScan:
    """Finds where one JSON value ends. `run(text, start)` scans on from where the last run
    stopped (from `start` the first time) and returns the index just past the value, None
    while it has not ended, or -1 where no value starts at `start`. `depth=1` starts inside
    an object or array (to find where the rest of it ends)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.started = depth > 0
        self.in_string = False
        self.escaped = False
        self.primitive = False
        self.i: int | None = None

    def run(self, text: str, start: int) -> int | None:
        i = start if self.i is None else self.i
        n = len(text)
        if not self.started and i < n:
            i = self._start(text[i], i)
            if i < 0:
                return -1
        while i < n:
            c = text[i]
            i += 1
            if self.primitive:
                if c not in PRIMITIVE:
                    self.i = i - 1
                    return i - 1
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.i = i
                        return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.i = i
                    return i
        self.i = i
        return None

    def _start(self, c: str, i: int) -> int:
        self.started = True
        if c in "{[":
            self.depth = 1
        elif c == '"':
            self.in_string = True
        elif c in PRIMITIVE:
            self.primitive = True
        else:
            return -1
        return i + 1


def decode_string(text: str, i: int, eof: bool) -> tuple[str, int, bool]:
    """Decode the body of a JSON string from `text[i]` (past its opening quote) as far as the
    text allows: (decoded text, where decoding stopped, whether the closing quote was read).
    An escape cut short waits for the rest unless `eof`; an invalid escape is kept as
    written; an unpaired surrogate becomes U+FFFD."""
    out: list[str] = []
    n = len(text)
    while i < n:
        c = text[i]
        if c == '"':
            return "".join(out), i + 1, True
        if c != "\\":
            out.append(c)
            i += 1
            continue
        piece, step = _escape(text, i, eof)
        if step == 0:
            break
        out.append(piece)
        i += step
    if eof and i < n:
        out.append(text[i:])
        i = n
    return "".join(out), i, False


def _escape(text: str, i: int, eof: bool) -> tuple[str, int]:
    """The escape at `text[i]` (a backslash): (its text, its length); length 0 while the text
    so far cannot tell."""
    if i + 1 >= len(text):
        return "", 0
    e = text[i + 1]
    if e in ESCAPES:
        return ESCAPES[e], 2
    if e != "u":
        return text[i:i + 2], 2
    if i + 6 > len(text):
        return ("", 0) if not eof else (text[i:], len(text) - i)
    digits = text[i + 2:i + 6]
    if not _HEX4.fullmatch(digits):
        return text[i:i + 2], 2
    code = int(digits, 16)
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", 6
    if not 0xD800 <= code < 0xDC00:
        return chr(code), 6
    low = text[i + 6:i + 12]
    if len(low) == 6 and low[:2] == "\\u" and _HEX4.fullmatch(low[2:]) \
            and 0xDC00 <= int(low[2:], 16) < 0xE000:
        return chr(0x10000 + ((code - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00)), 12
    if len(low) < 6 and not eof and _LOW_HALF_START.fullmatch(low):
        return "", 0
    return "\ufffd", 6
