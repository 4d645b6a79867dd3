"""Feeding tool-call parsers in pieces and reassembling OpenAI deltas, as a client does."""

from __future__ import annotations

import json
import random

from specserve.server.tool_calls.families import ToolFormat
from specserve.server.tool_calls.parser import (ParsedOutput, ToolCallParser, parse_output,
                                                stream_deltas)


def streamed(fmt: ToolFormat, pieces: list[str], max_calls: int | None = None,
             names: frozenset[str] | None = None) -> list[dict]:
    """The OpenAI deltas of an output fed in `pieces`, then finished."""
    parser, ids, deltas = ToolCallParser(fmt, max_calls, names), [], []
    for piece in pieces:
        deltas += stream_deltas(parser.feed(piece), ids)
    return deltas + stream_deltas(parser.finish(), ids)


def reassemble(deltas: list[dict]) -> ParsedOutput:
    """Content and calls as a client accumulates them, checking OpenAI's delta shapes: a
    call's first delta has its index, id, type, name and empty arguments; the later ones
    only its index and an arguments fragment."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(calls) and c["id"].startswith("call_")
                assert len(c["id"]) == 29
                assert c["type"] == "function" and c["function"]["arguments"] == ""
                calls[c["index"]] = [c["function"]["name"], ""]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]][1] += c["function"]["arguments"]
    return ParsedOutput(content, [tuple(calls[i]) for i in range(len(calls))])


def cuts(text: str, seed: int = 0) -> list[list[str]]:
    """`text` cut in two at every place, one character at a time, and at random places."""
    rng = random.Random(seed)
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        out.append([text[a:b] for a, b in zip([0] + points, points + [len(text)])])
    return out


def whole(fmt: ToolFormat, text: str, max_calls: int | None = None,
          names: frozenset[str] | None = None) -> ParsedOutput:
    return parse_output(fmt, text, max_calls, names)


def arguments(call: tuple[str, str]) -> object:
    return json.loads(call[1])
