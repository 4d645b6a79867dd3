"""Reading JSON a piece at a time: where a value ends (`JsonScan`) and a string's decoded text
(`decode_string`), each resumable where the text so far ran out.

`JsonScan` checks the value's syntax as it reads (`json.loads` still decodes it where it
matters). Both work by characters, so a value cut anywhere reads the same.
"""

from __future__ import annotations

import re

ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
           "t": "\t"}
PRIMITIVE = frozenset("0123456789+-.eEtrufalsn")
WS = " \t\r\n"
CLOSE = {"{": "}", "[": "]"}
# scanner states: a value is due; the first item of an array (or its end); the first key of
# an object (or its end); a key after a comma; a key's string; a ':'; a string value; a
# number or literal; a value just ended (a ',' or a closing bracket is due)
VALUE, FIRST_ITEM, FIRST_KEY, NEXT_KEY, KEY, COLON, STRING, TOKEN, AFTER = range(9)
_TOKEN = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")
# what may still become the low half of a surrogate pair: "\uDC00" to "\uDFFF", cut anywhere
_LOW_HALF_START = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


class JsonScan:
    """Finds where one JSON value ends, checking its syntax as it goes (a value that stops
    being JSON is known at that character, so a parser waits no longer on it). `run(text,
    start)` scans on from where the last run stopped (from `start` the first time) and
    returns the index just past the value, None while it has not ended (`i`: how far it has
    read), or -1 where the text
    from `start` is not a JSON value (`failed_at`: the character that showed it). Numbers and
    literals are checked as a whole where they end; a string may not hold a raw control
    character (as `json.loads` has it). `depth=1` starts inside an object just after one of
    its values (to find where the rest of it ends). Each character is read once, so scanning
    is linear in the text however it arrives."""

    def __init__(self, depth: int = 0) -> None:
        self.stack: list[str] = ["{"] if depth else []  # open brackets, innermost last
        self.state = AFTER if depth else VALUE
        self.escaped = False
        self.token_start = 0  # where the current number or literal began
        self.i: int | None = None
        self.failed_at: int | None = None

    def run(self, text: str, start: int, stop: int | None = None) -> int | None:
        """`stop`: read no further than this index (None: to the end of `text`)."""
        if self.failed_at is not None:
            return -1
        i = start if self.i is None else self.i
        n = len(text) if stop is None else min(len(text), stop)
        while i < n:
            c = text[i]
            state = self.state
            if state == STRING or state == KEY:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.state = COLON if state == KEY else AFTER
                    if state == STRING and not self.stack:
                        self.i = i + 1
                        return i + 1
                elif c < " ":
                    return self._fail(i)
                i += 1
                continue
            if state == TOKEN:
                if c in PRIMITIVE:
                    i += 1
                    continue
                if not _TOKEN.fullmatch(text, self.token_start, i):
                    return self._fail(self.token_start)
                self.state = AFTER
                if not self.stack:
                    self.i = i
                    return i
                continue  # the character after the token is read in state AFTER
            i += 1
            if c in WS:
                continue
            if state == VALUE or state == FIRST_ITEM:
                if c == "]" and state == FIRST_ITEM:
                    end = self._close(i)
                elif c in "{[":
                    self.stack.append(c)
                    self.state = FIRST_KEY if c == "{" else FIRST_ITEM
                    continue
                elif c == '"':
                    self.state = STRING
                    continue
                elif c in PRIMITIVE:
                    self.state, self.token_start = TOKEN, i - 1
                    continue
                else:
                    return self._fail(i - 1)
            elif state == FIRST_KEY or state == NEXT_KEY:
                if c == '"':
                    self.state = KEY
                    continue
                if c != "}" or state == NEXT_KEY:
                    return self._fail(i - 1)
                end = self._close(i)
            elif state == COLON:
                if c != ":":
                    return self._fail(i - 1)
                self.state = VALUE
                continue
            else:  # AFTER a value inside a bracket
                top = self.stack[-1]
                if c == ",":
                    self.state = NEXT_KEY if top == "{" else VALUE
                    continue
                if c != CLOSE[top]:
                    return self._fail(i - 1)
                end = self._close(i)
            if end is not None:
                return end
        self.i = i
        return None

    def _close(self, i: int) -> int | None:
        """A bracket closed just before `i`: the value's end once no bracket is open."""
        self.stack.pop()
        self.state = AFTER
        if self.stack:
            return None
        self.i = i
        return i

    def _fail(self, i: int) -> int:
        self.failed_at = self.i = i
        return -1


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
