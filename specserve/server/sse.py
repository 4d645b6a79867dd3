"""Server-sent events as the OpenAI API streams them: `data: {json}` blocks, then `data: [DONE]`."""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"
COMMENT = ": keep-alive\n\n"  # a comment line: clients skip it, the connection stays busy
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict) -> str:
    """One SSE event carrying `payload` as compact JSON (one line: JSON escapes newlines)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_event(name: str, payload: dict) -> str:
    """One SSE event with an `event:` line (the Responses and Messages APIs name each event
    by its type)."""
    return f"event: {name}\n{event(payload)}"
