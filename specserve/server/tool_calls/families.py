"""Which tool-call format a model writes, told from its chat template, and the text a grammar
holds a call to in each (`Structural`'s `begin`, values joined by `separator`, `end`).

Detection: a template that writes `<tool_call>` is `hermes`, one that writes `[TOOL_CALLS]` is
`mistral`, a Llama 3 header template that shows tools with `"parameters"` or
`<|python_tag|>` is `llama3_json`; any other (no tool syntax, or one we do not read) gets
`generic`: the tools described in a system prompt of ours, the answer one JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specserve.server.tool_calls import formats


@dataclass(frozen=True)
class ToolFormat:
    """`native`: the chat template renders tools, calls and results itself. Under a
    grammar, calls are `begin` value (`separator` value)* `end` (`Structural`), each value
    `{"name": ..., <arguments_key>: {...}}`; `begin` empty: no trigger for tool_choice
    "auto" (the format has no marker to start a constraint at)."""

    name: str
    parse: Callable = formats.generic
    native: bool = True
    begin: str = ""
    separator: str = ""
    end: str = ""
    arguments_key: str = "arguments"


HERMES = ToolFormat("hermes", formats.hermes, begin="<tool_call>\n",
                    separator="\n</tool_call>\n<tool_call>\n", end="\n</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", formats.llama3_json, separator="; ",
                         arguments_key="parameters")
MISTRAL = ToolFormat("mistral", formats.mistral, begin="[TOOL_CALLS][", separator=", ", end="]")
GENERIC = ToolFormat("generic", formats.generic, native=False, begin='{"tool_calls": [',
                     separator=", ", end="]}")
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, GENERIC)


def detect(template: str | None) -> ToolFormat:
    template = template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|start_header_id|>" in template and "tools" in template and (
            '"parameters"' in template or "<|python_tag|>" in template):
        return LLAMA3_JSON
    return GENERIC
