"""Tool calls and structured outputs on the OpenAI API (`tools`, `tool_choice`,
`parallel_tool_calls`, `response_format`, `structured_outputs`).

- `families.py`: which format a model writes calls in, told from its chat template;
- `conversation.py`: a request's messages and tools as the template takes them;
- `constraints.py`: the `StructuredOutputsParams` a request's output is held to;
- `formats.py` (on `reader.py`, `json_scan.py`): a parser per format;
- `parser.py`: parsing an output whole or as it streams, into OpenAI's deltas.

`ToolSupport` is what a server knows about its model's tools, computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.server.tool_calls.families import ToolFormat, detect

PROBE = "\ue000specserve-system-probe\ue001"


@dataclass(frozen=True)
class ToolSupport:
    format: ToolFormat
    system_shown: bool  # whether the template shows a system message's content


def tool_support(tokenizer) -> ToolSupport:
    """The model's tool-call format and whether its template shows a system prompt."""
    try:
        shown = PROBE in tokenizer.apply_chat_template(
            [{"role": "system", "content": PROBE}, {"role": "user", "content": "x"}])
    except ValueError:  # no template, or one that refuses system messages
        shown = False
    return ToolSupport(detect(tokenizer.chat_template), shown)
