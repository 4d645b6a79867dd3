"""Reading JSON a piece at a time: a string decodes the same cut anywhere (escapes and
surrogate pairs included) and a value's end is found wherever the text stops."""

from __future__ import annotations

import json

import pytest

from specserve.server.tool_calls.json_scan import JsonScan, decode_string

STRINGS = ['"plain"', '"quote \\" and backslash \\\\ and slash \\/"', '"\\b\\f\\n\\r\\t"',
           '"\\u00e9\\u4e2d"', '"emoji \\ud83d\\ude00 pair"', '"raw \u00e9 \U0001F600"', '""']


def decode_in_pieces(text: str, cut: int) -> tuple[str, bool]:
    out, i, closed = decode_string(text[:cut], 1, False) if cut > 0 else ("", 1, False)
    if closed:
        return out, closed
    rest, i, closed = decode_string(text, i, True)
    return out + rest, closed


@pytest.mark.parametrize("text", STRINGS)
def test_a_json_string_decodes_as_json_loads_does_cut_anywhere(text):
    for cut in range(len(text) + 1):
        assert decode_in_pieces(text, cut) == (json.loads(text), True)


def test_escapes_that_json_refuses_are_kept_and_lone_surrogates_replaced():
    odd = '"\\x41 \\ud83d alone \\ude00"'
    assert decode_string(odd, 1, True) == ("\\x41 \ufffd alone \ufffd", len(odd), True)
    assert decode_string('"cut \\u00', 1, False) == ("cut ", 5, False)  # waits for the digits
    assert decode_string('"cut \\u00', 1, True) == ("cut \\u00", 9, False)  # the end: as written
    assert decode_string('"pair \\ud83d\\u', 1, False) == ("pair ", 6, False)  # may be a pair


@pytest.mark.parametrize("text,end", [('{"a": [1, {"b": "}"}]} tail', 22), ("[1, 2]x", 6),
                                      ('"s\\"q" x', 6), ("12.5e3, 1", 6), ("true}", 4)])
def test_the_end_of_a_value_is_found_wherever_the_text_stops(text, end):
    for cut in range(len(text) + 1):
        scan = JsonScan()
        first = scan.run(text[:cut], 0)
        found = first if first is not None else scan.run(text, 0)
        assert found == end, cut


def test_no_value_starts_at_a_closing_bracket_and_the_rest_of_an_object_ends_at_its_brace():
    assert JsonScan().run("}", 0) == -1
    assert JsonScan(depth=1).run(', "id": "x}"} more', 0) == 13


@pytest.mark.parametrize("text,at", [('{"a" 1}', 5), ("{```{", 1), ('[1, ]', 4), ('{"a": tru}', 6),
                                     ('{"a": "x\ny"}', 8), ("[1 2]", 3), ('{"a": 1,}', 8)])
def test_a_value_that_stops_being_json_is_known_at_that_character(text, at):
    for cut in range(len(text) + 1):
        scan = JsonScan()
        first = scan.run(text[:cut], 0)
        assert (first if first is not None else scan.run(text, 0)) == -1, cut
        assert scan.failed_at == at


def test_scanning_stops_where_told_and_goes_on_from_there():
    scan = JsonScan()
    assert scan.run('{"a": [1, 2]}', 0, 5) is None and scan.i == 5
    assert scan.run('{"a": [1, 2]}', 0) == 13


def test_model_output_full_of_unclosed_openers_parses_in_linear_time():
    """Each opener starts a candidate call; the old scanner read from every one of them to the
    end (64k characters: minutes). Fed whole or in pieces, the parse reads each character a
    bounded number of times: well under a second here, 5 s is the bound for a loaded CI box."""
    import time

    from specserve.server.tool_calls.families import HERMES
    from specserve.server.tool_calls.parser import ToolCallParser, parse_output

    text = "```{" * 16_384 + '<tool_call>\n{"a": [' * 2_000
    start = time.perf_counter()
    parsed = parse_output(HERMES, text)
    parser = ToolCallParser(HERMES)
    for i in range(0, len(text), 97):
        parser.feed(text[i:i + 97])
    parser.finish()
    assert time.perf_counter() - start < 5
    assert parsed.content == text and not parsed.calls
