"""Which tool-call format a model writes, told from its chat template, and the text a grammar
holds a call to in each (`Structural`'s `begin`, values joined by `separator`, `end`).

Under tool_choice "auto" a format also says where a call may start (`CallForm`): from there
on, the grammar holds the rest of the call (`call_grammar.py`). Each form is one the format's
parser reads as a call: its marker anywhere, a ```json fence (hermes), a bare
`{"name": ` opening the output.

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
class CallForm:
    """One way a call starts under tool_choice "auto": once the output holds `trigger`
    (anywhere, or only where the output opens, whitespace before it), the grammar holds the
    rest: `before`, then calls (each after `separator` past the first; one call where it is
    None), then `after`. `named`: the trigger ends inside the first call, after its
    `{"name": `."""

    trigger: str
    anywhere: bool = True
    before: str = ""
    separator: str | None = None
    after: str = ""
    named: bool = False


BARE = '{"name": '


@dataclass(frozen=True)
class ToolFormat:
    """`native`: the chat template renders tools, calls and results itself. Under a
    grammar, calls are `begin` value (`separator` value)* `end` (the canonical form, for
    tool_choice "required" or a named function), each value `{"name": ..., <arguments_key>:
    {...}}`; `forms`: where a call may start under "auto"."""

    name: str
    parse: Callable = formats.generic
    native: bool = True
    begin: str = ""
    separator: str = ""
    end: str = ""
    arguments_key: str = "arguments"
    forms: tuple[CallForm, ...] = ()


HERMES = ToolFormat("hermes", formats.hermes, begin="<tool_call>\n",
                    separator="\n</tool_call>\n<tool_call>\n", end="\n</tool_call>", forms=(
                        CallForm("<tool_call>", before="\n", after="\n</tool_call>"),
                        CallForm("```json", before="\n", after="\n```"),
                        CallForm("```" + BARE, named=True, after="\n```"),
                        CallForm(BARE, anywhere=False, named=True)))
LLAMA3_JSON = ToolFormat("llama3_json", formats.llama3_json, separator="; ",
                         arguments_key="parameters",
                         forms=(CallForm(BARE, anywhere=False, separator="; ", named=True),))
MISTRAL = ToolFormat("mistral", formats.mistral, begin="[TOOL_CALLS][", separator=", ", end="]",
                     forms=(CallForm("[TOOL_CALLS]", before="[", separator=", ", after="]"),
                            CallForm("[" + BARE, anywhere=False, separator=", ", after="]",
                                     named=True)))
GENERIC = ToolFormat("generic", formats.generic, native=False, begin='{"tool_calls": [',
                     separator=", ", end="]}", forms=(
                         CallForm('{"tool_calls": [', anywhere=False, separator=", ", after="]}"),
                         CallForm(BARE, anywhere=False, named=True)))
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
