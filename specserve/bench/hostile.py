"""Hostile clients for the soak run, on raw sockets (an HTTP library would read, send and
close as a polite client does). Each returns one outcome word:

- `stalled_stream`: sends a streaming chat request and reads nothing for `hold_s` seconds,
  then reads for at most 10 s: "dropped" (the server closed it before its end: the write
  timeout), "completed" (the whole answer was sent), "refused" (429), "open" (still open and
  unfinished: the server's buffers had not filled, so the write timeout had not started; a
  server that never drops a stalled client shows here), "error" (any other answer);
- `trickled_body`: sends a request head, then its body a byte at a time: "timed_out" (the
  server answered 408 and closed), "held" (no answer within `give_up_s`), "error";
- `half_open`: opens a connection, sends half a request head and goes silent: "closed" (the
  server closed it), "held" (still open after `give_up_s`);
- `flood`: `streams` streaming requests at once that are never read and `heads` requests whose
  bodies never end, kept `hold_s` seconds, then read as `stalled_stream` reads: the outcome of
  each stream ("dropped", "completed", "open", "refused", "error"), the heads' ("timed_out",
  "held", "error");
- `deep`: a request nested past the server's JSON depth bound, one of `DEEP_KINDS` in turn
  (a body 1,000 deep, a `structured_outputs.json` text 50,000 deep, a strict tool schema
  300 deep, tool-call arguments 50,000 deep): "4xx" (refused, as it must be), "5xx", "ok".
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

RECEIVE_WINDOW = 4096  # the receive buffer of a client that reads nothing: a small window
DEEP_KINDS = ("body", "schema_text", "tool_schema", "arguments")


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _head(method: str, path: str, api_key: str | None, length: int) -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: "
            f"application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything until the server closes the connection (True), or until `timeout` seconds
    have passed (False)."""
    deadline, data = time.monotonic() + timeout, b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                return data, True
            data += chunk
    except TimeoutError:
        pass
    except ConnectionResetError:  # dropped: the kernel reset what it still had to send
        return data, True
    return data, False


def _status_line(sock: socket.socket, timeout: float) -> bytes:
    """The first bytes of the answer (its status line), or b"" if none came within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(len(b"HTTP/1.1 200"))
    except (TimeoutError, ConnectionResetError):
        return b""


def stalled_stream(url: str, api_key: str | None, model: str, prompt: str, max_tokens: int,
                   hold_s: float) -> str:
    with _unread(url, api_key, model, prompt, max_tokens, logprobs=True) as sock:
        start = time.monotonic()
        head = _status_line(sock, hold_s)
        if head.startswith(b"HTTP/1.1 429"):  # refused at once: try again soon, not after hold_s
            time.sleep(0.2)
            return "refused"
        time.sleep(max(0.0, hold_s - (time.monotonic() - start)))
        return _stalled_outcome(sock, head)


def _unread(url: str, api_key: str | None, model: str, prompt: str, max_tokens: int,
            logprobs: bool) -> socket.socket:
    """A connection that has sent a streaming chat request and reads nothing."""
    fields = {"logprobs": True, "top_logprobs": 20} if logprobs else {}
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       **fields}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_WINDOW)
    sock.connect(address(url))
    sock.sendall(_head("POST", "/v1/chat/completions", api_key, len(body)) + body)
    return sock


def _stalled_outcome(sock: socket.socket, head: bytes = b"") -> str:
    """Read what a stalled stream's connection holds (at most 10 s): its outcome word."""
    data, closed = _read_until_closed(sock, timeout=10)
    data = head + data
    if data.startswith(b"HTTP/1.1 429"):
        return "refused"
    if not data.startswith(b"HTTP/1.1 200"):
        return "error"
    if b"data: [DONE]" in data:
        return "completed"
    return "dropped" if closed else "open"


def flood(url: str, api_key: str | None, model: str, prompt: str, streams: int, heads: int,
          max_tokens: int, hold_s: float) -> list[str]:
    """`streams` unread streams and `heads` endless bodies at once, held `hold_s` seconds;
    the outcome of each (see the module)."""
    opened = [_unread(url, api_key, model, prompt, max_tokens, logprobs=False)
              for _ in range(streams)]
    endless = []
    for _ in range(heads):
        sock = socket.create_connection(address(url))
        sock.sendall(_head("POST", "/v1/chat/completions", api_key, 1000) + b'{"model": ')
        endless.append(sock)
    time.sleep(hold_s)
    outcomes = []
    for sock in opened:
        with sock:
            outcomes.append(_stalled_outcome(sock))
    for sock in endless:
        with sock:
            data, closed = _read_until_closed(sock, timeout=1)
            outcomes.append("timed_out" if data.startswith(b"HTTP/1.1 408") and closed
                            else "held" if not data else "error")
    return outcomes


def deep(url: str, api_key: str | None, model: str, turn: int) -> str:
    """One request nested past the depth bound (`DEEP_KINDS[turn % 4]`): "4xx", "5xx", "ok"."""
    kind = DEEP_KINDS[turn % len(DEEP_KINDS)]
    ask = [{"role": "user", "content": "hi"}]
    nested = "[" * 50_000 + "]" * 50_000
    if kind == "body":
        body = ('{"model": %s, "messages": %s}' % (json.dumps(model), "[" * 1000 + "]" * 1000))
    elif kind == "schema_text":
        body = json.dumps({"model": model, "messages": ask,
                           "structured_outputs": {"json": nested}})
    elif kind == "tool_schema":
        schema: dict = {"type": "string"}
        for _ in range(300):
            schema = {"type": "object", "properties": {"a": schema}}
        body = json.dumps({"model": model, "messages": ask, "tools": [{"type": "function",
                           "function": {"name": "f", "strict": True, "parameters": schema}}]})
    else:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested}}
        body = json.dumps({"model": model, "messages": ask + [
            {"role": "assistant", "content": None, "tool_calls": [call]}]})
    raw = body.encode()
    with socket.create_connection(address(url), timeout=60) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", api_key, len(raw)) + raw)
        status = _status_line(sock, 60)
    code = status[9:12]
    return "5xx" if code.startswith(b"5") else "4xx" if code.startswith(b"4") else \
        "ok" if code.startswith(b"2") else "error"


def trickled_body(url: str, api_key: str | None, pause_s: float, give_up_s: float) -> str:
    with socket.create_connection(address(url)) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", api_key, 1000))
        sock.settimeout(pause_s)
        start = time.monotonic()
        while time.monotonic() - start < give_up_s:
            try:
                sock.sendall(b" ")
                answer = sock.recv(1 << 16)
            except TimeoutError:
                continue  # nothing yet: trickle on
            except (BrokenPipeError, ConnectionResetError):
                return "timed_out"
            if not answer:
                return "error"  # closed without an answer
            return "timed_out" if answer.startswith(b"HTTP/1.1 408") else "error"
    return "held"


def half_open(url: str, give_up_s: float) -> str:
    with socket.create_connection(address(url)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        _, closed = _read_until_closed(sock, timeout=give_up_s)
    return "closed" if closed else "held"
