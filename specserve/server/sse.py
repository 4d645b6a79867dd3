"""Server-sent events as the OpenAI API streams them: `data: {json}` blocks, then `data: [DONE]`."""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict) -> str:
    """One SSE event carrying `payload` as compact JSON (one line: JSON escapes newlines)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def parse(stream_text: str) -> list[dict | str]:
    """The payloads of an SSE stream, in order ("[DONE]" as the string). Inverse of `event`."""
    payloads: list[dict | str] = []
    for block in stream_text.split("\n\n"):
        if not block.strip():
            continue
        data = "\n".join(line[len("data:"):].lstrip() for line in block.splitlines()
                         if line.startswith("data:"))
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
