"""Parsing a model's output into content and tool calls, whole or as it streams.

`ToolCallParser(fmt)` is fed the output's text deltas (`feed`) and then `finish()`; each
returns the events the text so far decided (see `reader.py`). `parse_output` is the same
parser fed the whole output at once, so a streamed response reassembles to exactly the
non-streamed one. `stream_deltas` turns events into OpenAI's `delta` objects.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from specserve.server.tool_calls.families import ToolFormat
from specserve.server.tool_calls.reader import Reader


class ToolCallParser:
    def __init__(self, fmt: ToolFormat, max_calls: int | None = None,
                 names: frozenset[str] | None = None) -> None:
        self._reader = Reader(max_calls, names)
        self._parse = fmt.parse(self._reader)
        self._done = False

    def feed(self, text: str) -> list[tuple]:
        self._reader.text += text
        return self._step()

    def finish(self) -> list[tuple]:
        self._reader.eof = True
        events = self._step()
        assert self._done, "a tool-call parser must end at the end of the output"
        self._reader.end()
        return events + self._take()

    def _step(self) -> list[tuple]:
        if not self._done:
            try:
                next(self._parse)
            except StopIteration:
                self._done = True
        return self._take()

    def _take(self) -> list[tuple]:
        events, self._reader.events = self._reader.events, []
        return events


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[tuple[str, str]]  # (name, arguments as JSON text)


def parse_output(fmt: ToolFormat, text: str, max_calls: int | None = None,
                 names: frozenset[str] | None = None) -> ParsedOutput:
    parser = ToolCallParser(fmt, max_calls, names)
    return collect(parser.feed(text) + parser.finish())


def collect(events: list[tuple]) -> ParsedOutput:
    """The content and calls of a whole output's events; a cut call's text is content, where
    it was written."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for event in events:
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            calls[event[1]] = [event[2], ""]
        elif event[0] == "args":
            calls[event[1]][1] += event[2]
        elif event[0] == "cut":
            del calls[event[1]]
            content.append(event[2])
    return ParsedOutput("".join(content), [(name, args) for name, args in calls.values()])


def new_call_id() -> str:
    """An id as OpenAI writes them: `call_` and 24 hexadecimal digits."""
    return f"call_{secrets.token_hex(12)}"


def stream_deltas(events: list[tuple], call_ids: list[str]) -> list[dict]:
    """OpenAI stream deltas of `events`, in order: `{"content"}`; a call's first
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}`; then
    `{"tool_calls": [{"index", "function": {"arguments": fragment}}]}`, the fragments of one
    call that follow each other joined. `call_ids` gets the id of each new call; a cut call's
    becomes None (what was sent of it cannot be taken back; it is no call of the output)."""
    deltas: list[dict] = []
    for event in events:
        last = deltas[-1] if deltas else {}
        if event[0] == "cut":
            call_ids[event[1]] = None
        elif event[0] == "end":
            continue
        elif event[0] == "content":
            if "content" in last:
                last["content"] += event[1]
            else:
                deltas.append({"content": event[1]})
        elif event[0] == "call":
            call_ids.append(new_call_id())
            deltas.append({"tool_calls": [{
                "index": event[1], "id": call_ids[-1], "type": "function",
                "function": {"name": event[2], "arguments": ""}}]})
        elif "tool_calls" in last and "id" not in last["tool_calls"][0] \
                and last["tool_calls"][0]["index"] == event[1]:
            last["tool_calls"][0]["function"]["arguments"] += event[2]
        else:
            fragment = {"index": event[1], "function": {"arguments": event[2]}}
            deltas.append({"tool_calls": [fragment]})
    return deltas


@dataclass(frozen=True)
class ToolParsing:
    """A job's tool calls are read from its output in `format`; calls past `max_calls` (1
    where parallel_tool_calls is false) are dropped, calls to functions not in `names` are
    not calls (None: any name)."""

    format: ToolFormat
    max_calls: int | None = None
    names: frozenset[str] | None = None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, self.max_calls, self.names)

    def parse(self, text: str) -> ParsedOutput:
        return parse_output(self.format, text, self.max_calls, self.names)
