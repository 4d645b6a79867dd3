"""The one reader of the server's event streams (Server-Sent Events) for the benchmarks.

`events(lines)` turns the lines of a streamed response (`httpx`'s `iter_lines()`, or the
bytes lines of an `http.client` response) into its events: each `data:` line's JSON object,
and `DONE` for the `[DONE]` that ends a stream; with `every_line`, a None for each other line
(blank separators, comments), for a reader that paces or counts lines. `post_stream` sends one
streamed request with `http.client` and returns the response, for the scripts that time each
event themselves.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterable, Iterator

DONE = "[DONE]"  # the event that ends a stream


def events(lines: Iterable[str | bytes], every_line: bool = False) -> Iterator[dict | str | None]:
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        line = line.strip()
        if not line.startswith("data:"):
            if every_line:
                yield None
            continue
        data = line[5:].strip()
        yield DONE if data == DONE else json.loads(data)


def post_stream(port: int, path: str, body: dict, api_key: str | None = None,
                timeout: float = 1800, host: str = "127.0.0.1"
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST `body` (JSON) to `path` on `host:port`; (the connection, its response). Raises
    RuntimeError naming the port and status where the answer is not 200."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
    return conn, resp
