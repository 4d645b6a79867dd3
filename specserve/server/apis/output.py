"""One completion's output as the agents' wires give it: text and whole tool calls, in order.

`OutputReader` reads a completion's text deltas with the request's tool-call parser (none: the
output is all text) and gives `Text` and `Call` items in the order written. A call is given
once its arguments are whole (valid JSON), never before: a call cut short by `max_tokens`, or
whose arguments stop being JSON, is given as the text it was written as. So what a wire
streams and the body it would have sent whole are the same, item for item.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from specserve.engine.outputs import CompletionOutput
from specserve.server.tool_calls.parser import ToolParsing


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


class OutputReader:
    def __init__(self, parsing: ToolParsing | None) -> None:
        self._parser = parsing.parser() if parsing is not None else None
        self._open: dict[int, list[str]] = {}  # a call being written: [name, arguments so far]
        self.calls = 0  # calls given so far

    def feed(self, text: str, final: bool = False) -> list[Text | Call]:
        """The items `text` (the output's next piece; `final`: its last) completes."""
        if self._parser is None:
            return [Text(text)] if text else []
        events = self._parser.feed(text) if text else []
        if final:
            events += self._parser.finish()
        items: list[Text | Call] = []
        for event in events:
            if event[0] == "content":
                _add_text(items, event[1])
            elif event[0] == "call":
                self._open[event[1]] = [event[2], ""]
            elif event[0] == "args":
                self._open[event[1]][1] += event[2]
            elif event[0] == "end":
                name, arguments = self._open.pop(event[1])
                items.append(Call(name, arguments))
                self.calls += 1
            else:  # "cut": no call after all, its text as written
                del self._open[event[1]]
                _add_text(items, event[2])
        return items


def _add_text(items: list[Text | Call], text: str) -> None:
    if items and isinstance(items[-1], Text):
        items[-1] = Text(items[-1].text + text)
    elif text:
        items.append(Text(text))


def ending(c: CompletionOutput, calls: int) -> str:
    """How a completion ended, in the words both wires map from: "tool_use" (it made calls
    and stopped on its own), "stop_sequence" (a stop string or stop token), "end_turn" (EOS),
    "max_tokens" (max_tokens or the context), "abort"."""
    if c.finish_reason == "length":
        return "max_tokens"
    if c.finish_reason != "stop":
        return "abort"
    if calls:
        return "tool_use"
    return "stop_sequence" if c.stop_reason is not None else "end_turn"


def new_id(prefix: str) -> str:
    """An id as both APIs write them: a prefix and 24 hexadecimal digits."""
    return f"{prefix}{secrets.token_hex(12)}"
