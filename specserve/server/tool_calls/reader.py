"""The incremental reader the tool-call parsers are written on.

A parser is a generator over a `Reader`: it reads `reader.text` from `reader.pos` with the
waiting primitives below (`literal`, `ws`, `peek`, ...), each a generator used with
`yield from` that yields while the text so far cannot decide it and returns once it can
(at the end of the output, `eof`, everything can). So every decision a parser takes
depends on the whole output only, never on where the deltas were cut: fed in any pieces,
a parser emits the same events, in the same order, as fed the whole output at once.

Events: `("content", text)`, `("call", index, name)`, `("args", index, fragment)`,
`("end", index)` once a call's arguments are whole (valid JSON: the call stands), and
`("cut", index, text)` where a call whose head was read never became one (its arguments
stopped being JSON, or the output ended inside them): `text` is all of it as written, which
a whole output keeps as content instead of the call. Content keeps the output's text but for
the whitespace around tool calls: whitespace just before a call, just after one, and at the
end of an output that made calls is dropped.

`names` (the functions the request declares; None: any): a call to another name is not a
call, its text stays content. A candidate call not decided within `MAX_UNDECIDED_CHARS`
(a value that might still be a call in another key order) is content too, so no text waits
longer than that, and no character is read more than a bounded number of times.
"""

from __future__ import annotations

from specserve.server.tool_calls.json_scan import JsonScan, decode_string

WS = " \t\r\n"
MAX_UNDECIDED_CHARS = 32_768


class Reader:
    def __init__(self, max_calls: int | None = None,
                 names: frozenset[str] | None = None) -> None:
        self.text = ""
        self.pos = 0
        self.eof = False
        self.events: list[tuple] = []
        self.calls = 0
        self.max_calls = max_calls  # calls past this many are read but not emitted
        self.names = names  # the functions a call may name (None: any)
        self._pending = ""  # trailing whitespace of the content so far, held back
        self._after_call = False  # drop the whitespace that starts the next content
        self._before: dict[int, str] = {}  # the whitespace dropped before each call

    # ---------------------------------------------------------------- events
    def content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(WS)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(WS)
        if body:
            self.events.append(("content", self._pending + body))
            self._pending = text[len(body):]
        else:
            self._pending += text

    def call(self, name: str) -> int:
        """A call starts; its index (its events are dropped past `max_calls`)."""
        index, self.calls = self.calls, self.calls + 1
        self._before[index] = self._pending  # given back if the call is cut
        self._pending, self._after_call = "", True
        if self._emits(index):
            self.events.append(("call", index, name))
        return index

    def args(self, index: int, fragment: str) -> None:
        if fragment and self._emits(index):
            self.events.append(("args", index, fragment))

    def ended(self, index: int) -> None:
        """Call `index` has all its arguments."""
        if self._emits(index):
            self.events.append(("end", index))

    def cut(self, index: int, start: int) -> None:
        """Call `index`, written from `start` to `pos`, never became one."""
        if self._emits(index):
            self.events.append(("cut", index, self._before[index] + self.text[start:self.pos]))

    def declared(self, name: object) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def end(self) -> None:
        """The output is over: held whitespace is content unless calls were made."""
        if self._pending and not self.calls:
            self.events.append(("content", self._pending))
        self._pending = ""

    def _emits(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls

    # ---------------------------------------------------------------- waiting primitives
    def literal(self, lit: str):
        """Consume `lit` if the text at `pos` is it; False once it cannot be."""
        while True:
            got = self.text[self.pos:self.pos + len(lit)]
            if got == lit:
                self.pos += len(lit)
                return True
            if self.eof or not lit.startswith(got):
                return False
            yield

    def one_of(self, lits: tuple[str, ...]):
        """Consume whichever of `lits` (none a prefix of another) is at `pos`; None if none."""
        while True:
            for lit in lits:
                if self.text.startswith(lit, self.pos):
                    self.pos += len(lit)
                    return lit
            got = self.text[self.pos:self.pos + max(map(len, lits))]
            if self.eof or not any(lit.startswith(got) for lit in lits):
                return None
            yield

    def ws(self):
        """Skip whitespace, up to the next other character (or the end)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in WS:
                self.pos += 1
            if self.pos < len(self.text) or self.eof:
                return
            yield

    def peek(self):
        """The character at `pos` (None at the end of the output)."""
        while self.pos >= len(self.text):
            if self.eof:
                return None
            yield
        return self.text[self.pos]

    def value_end(self, limit: int = MAX_UNDECIDED_CHARS):
        """Where the JSON value at `pos` ends (just past it); None if it is not one, or does
        not end within `limit` characters. `pos` does not move."""
        scan = JsonScan()
        start = self.pos
        while True:
            end = scan.run(self.text, start, start + limit)
            if end is not None:
                return None if end < 0 else end
            if self.eof or scan.i >= start + limit:
                return None
            yield

    def stream_value(self, on_text, scan: JsonScan | None = None):
        """Consume the JSON value at `pos` (or, with `scan` started inside one, the rest of
        it), handing each newly read piece to `on_text`; True once it closed, False where it
        stopped being JSON (`pos` at that character) or the output ended inside it."""
        scan = scan or JsonScan()
        while True:
            end = scan.run(self.text, self.pos)
            stop = len(self.text) if end is None else scan.failed_at if end < 0 else end
            if stop > self.pos:
                on_text(self.text[self.pos:stop])
                self.pos = stop
            if end is not None or self.eof:
                return end is not None and end >= 0
            yield

    def stream_string(self, on_text):
        """Consume the JSON string at `pos` (its quote included), handing its decoded text
        to `on_text` piece by piece; True once it closed."""
        assert self.text[self.pos] == '"'
        self.pos += 1
        while True:
            text, self.pos, closed = decode_string(self.text, self.pos, self.eof)
            if text:
                on_text(text)
            if closed or self.eof:
                return closed
            yield

    def content_until(self, openers: tuple[str, ...]):
        """Emit content up to the first of `openers`; return it (`pos` at its start), or None
        once the output ended with no opener (all of it emitted). Text that may be the start
        of an opener is held back until it is known not to be."""
        searched = self.pos
        longest = max((len(o) for o in openers), default=0)
        while True:
            found = [(i, o) for o in openers if (i := self.text.find(o, searched)) >= 0]
            if found:
                i, opener = min(found)
                self.content(self.text[self.pos:i])
                self.pos = i
                return opener
            if self.eof:
                self.content(self.text[self.pos:])
                self.pos = len(self.text)
                return None
            stop = len(self.text) - _held(self.text, openers, self.pos)
            self.content(self.text[self.pos:stop])
            self.pos = stop
            searched = max(self.pos, len(self.text) - longest + 1)
            yield


def _held(text: str, openers: tuple[str, ...], start: int) -> int:
    """The length of the longest end of `text[start:]` that is a proper prefix of an opener."""
    best = 0
    for opener in openers:
        for k in range(min(len(opener) - 1, len(text) - start), best, -1):
            if opener.startswith(text[len(text) - k:]):
                best = k
                break
    return best
