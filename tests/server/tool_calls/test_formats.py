"""Each family's parser on hand-written model outputs: what becomes content and what calls,
and the same result streamed with the output cut anywhere, with no markup in the content."""

from __future__ import annotations

import pytest

from specserve.server.tool_calls.families import GENERIC, HERMES, LLAMA3_JSON, MISTRAL
from specserve.server.tool_calls.parser import ToolCallParser, stream_deltas
from tests.server.tool_calls.streams import arguments, cuts, reassemble, streamed, whole

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOKYO = '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": [1, 2]}}'
SEND = '{"name": "send_email", "arguments": {"to": "x"}}'
WEATHER = [("get_weather", {"city": "Paris"})]
BOTH = WEATHER + [("get_weather", {"city": "Tokyo", "days": [1, 2]})]

# (format, output, content, calls as (name, arguments object))
CASES = [
    (HERMES, f"<tool_call>\n{PARIS}\n</tool_call>", "", WEATHER),
    (HERMES, f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{TOKYO}\n</tool_call>", "", BOTH),
    (HERMES, f"Let me look that up.\n\n<tool_call>\n{PARIS}\n</tool_call>",
     "Let me look that up.", WEATHER),
    (HERMES, f"```json\n{PARIS}\n```", "", WEATHER),  # as Qwen2.5-Coder 1.5B answers
    (HERMES, f"  {PARIS}", "", WEATHER),  # a bare call object opening the output
    (HERMES, '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
     "", WEATHER),  # another key order: read whole
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
             '</tool_call>', "", WEATHER),  # arguments as a JSON string
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": }\n</tool_call>', []),  # malformed
    (HERMES, "<tool_call>\nget_weather(city='Paris')\n</tool_call> ok",
     "<tool_call>\nget_weather(city='Paris')\n</tool_call> ok", []),
    (HERMES, "Here:\n```python\nprint(1)\n```\nand <tool_ or <tool_call\n",
     "Here:\n```python\nprint(1)\n```\nand <tool_ or <tool_call\n", []),
    (HERMES, '```json\n{"name": "demo", "version": "1.0"}\n```',
     '```json\n{"name": "demo", "version": "1.0"}\n```', []),  # package.json is no call
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", WEATHER),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", WEATHER),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                  '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": [1, 2]}}',
     "", BOTH),
    (LLAMA3_JSON, 'It is sunny. {"name": "get_weather", "parameters": {}}',
     'It is sunny. {"name": "get_weather", "parameters": {}}', []),
    (LLAMA3_JSON, '{"name": 7, "parameters": {}} is not a call', '{"name": 7, "parameters": {}} '
                                                               'is not a call', []),
    (MISTRAL, f'[TOOL_CALLS] [{PARIS[:-1]}, "id": "abcdefghi"}}]', "", WEATHER),
    (MISTRAL, f"[TOOL_CALLS][{PARIS}, {TOKYO}]", "", BOTH),
    (MISTRAL, f"[{PARIS}]", "", WEATHER),  # the marker is a control token, dropped when decoded
    (MISTRAL, f"Sure. [TOOL_CALLS] [{PARIS}]", "Sure.", WEATHER),
    (MISTRAL, "[TOOL_CALLS] [oops] and [a link](x)", "[TOOL_CALLS] [oops] and [a link](x)", []),
    (GENERIC, f'{{"tool_calls": [{PARIS}, {TOKYO}]}}', "", BOTH),
    (GENERIC, f'```json\n{{"tool_calls": [{PARIS}]}}\n```', "", WEATHER),
    (GENERIC, '{"response": "Hi \\"you\\"\\n\\u00e9\\ud83d\\ude00 \\\\ done"}',
     'Hi "you"\n\u00e9\U0001F600 \\ done', []),
    (GENERIC, "Just text, {not JSON}.", "Just text, {not JSON}.", []),
    (GENERIC, '{"answer": 42}', '{"answer": 42}', []),
]
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"tool_calls"', "```")


def ids(case) -> str:
    return f"{case[0].name}:{case[1][:40]!r}"


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_a_whole_output_parses_into_its_content_and_calls(case):
    fmt, text, content, calls = case
    parsed = whole(fmt, text)
    assert parsed.content == content
    assert [(name, arguments((name, args))) for name, args in parsed.calls] == calls


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_streamed_at_any_cut_the_deltas_reassemble_to_the_whole_parse(case):
    fmt, text, _, calls = case
    expected = whole(fmt, text)
    for pieces in cuts(text):
        deltas = streamed(fmt, pieces)
        assert reassemble(deltas) == expected, pieces
        if calls:
            streamed_content = "".join(d.get("content", "") for d in deltas)
            assert not any(m in streamed_content for m in MARKUP), (pieces, streamed_content)


def test_arguments_stream_as_the_model_writes_them():
    text = f"<tool_call>\n{TOKYO}\n</tool_call>"
    deltas = streamed(HERMES, list(text))
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Tokyo", "days": [1, 2]}'


def test_text_that_may_start_a_marker_is_held_back_until_it_cannot():
    parser = ToolCallParser(HERMES)
    assert stream_deltas(parser.feed("The answer <tool"), []) == [{"content": "The answer"}]
    assert stream_deltas(parser.feed("_cal"), []) == []
    assert stream_deltas(parser.feed("box> is"), []) == [{"content": " <tool_calbox> is"}]
    assert stream_deltas(parser.finish(), []) == []


def test_a_call_cut_short_is_no_call_its_text_is_content():
    """The head committed the call; the output then ended (max_tokens) inside its arguments:
    a whole output gives no call with broken arguments, its text stays as written; streamed,
    the call's id is taken back. A call whose arguments stop being JSON mid-output alike."""
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parsed = whole(HERMES, text)
    assert parsed.calls == [] and parsed.content == "Checking.\n" + text[len("Checking.\n"):]
    cut = whole(LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Par')
    assert cut.calls == [] and cut.content == '{"name": "get_weather", "parameters": {"city": "Par'
    parser, ids = ToolCallParser(HERMES), []
    stream_deltas(parser.feed(text) + parser.finish(), ids)
    assert ids == [None]
    broken = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city" "Paris"}}}}\n' \
             f'</tool_call>\n<tool_call>\n{TOKYO}\n</tool_call>'
    parsed = whole(HERMES, broken)
    assert [arguments(c) for c in parsed.calls] == [{"city": "Tokyo", "days": [1, 2]}]
    assert parsed.content.startswith('<tool_call>\n{"name": "get_weather"')


def test_a_call_to_a_function_not_declared_is_content():
    names = frozenset({"get_weather"})
    for text in (f"<tool_call>\n{SEND}\n</tool_call>", f"```json\n{SEND}\n```", SEND,
                 '{"arguments": {"to": "x"}, "name": "send_email"}'):
        parsed = whole(HERMES, text, names=names)
        assert parsed.calls == [] and parsed.content == text, text
        assert all(reassemble(streamed(HERMES, p, names=names)) == parsed for p in cuts(text)[::5])
    assert whole(HERMES, f"<tool_call>\n{PARIS}\n</tool_call>", names=names).calls


def test_calls_past_max_calls_are_dropped_alike_whole_and_streamed():
    text = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{TOKYO}\n</tool_call>"
    one = whole(HERMES, text, max_calls=1)
    assert [arguments(c) for c in one.calls] == [{"city": "Paris"}] and one.content == ""
    assert all(reassemble(streamed(HERMES, p, max_calls=1)) == one for p in cuts(text)[::7])


def test_content_keeps_its_own_whitespace_when_no_call_is_made():
    for fmt in (HERMES, LLAMA3_JSON, MISTRAL, GENERIC):
        assert whole(fmt, "  two lines\n\n").content == "  two lines\n\n"
