"""Reading a server-sent event stream back into its payloads, as a client does (the server only
writes them: `specserve/server/sse.py`)."""

from __future__ import annotations

import json


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
