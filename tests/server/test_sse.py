"""SSE framing: one `data:` line per event, JSON that survives newlines, `[DONE]` last."""

from specserve.server import sse
from tests.server.sse_client import parse


def test_event_is_one_data_line_even_when_text_has_newlines():
    text = sse.event({"choices": [{"text": "a\nb\n\nc", "emoji": "é✓"}]})
    assert text.startswith("data: ") and text.endswith("\n\n")
    assert text.count("\n") == 2  # JSON escapes the payload's newlines


def test_parse_inverts_event_and_keeps_done_last():
    payloads = [{"i": 0, "text": "x\n\ny"}, {"i": 1, "usage": None}]
    stream = "".join(sse.event(p) for p in payloads) + sse.DONE
    assert parse(stream) == payloads + ["[DONE]"]
