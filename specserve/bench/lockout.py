"""The lockout check of issue 60 against a running server: `--streams` streaming chat requests
that are never read (`--tokens` each, EOS ignored) and `--heads` requests whose bodies never
end, opened at once; after `--settle` seconds a fresh client (a new connection, a short chat
request, from `--fresh-address` if given) is timed to its answer. Then the flood is closed and
the server left to go idle; `--repeats` times. One JSON line per repeat: the fresh client's
wait and status, the server's running / waiting / held counts when it was answered, and how
long the server took to go idle after the flood closed.

    python -m specserve.bench.lockout --url http://127.0.0.1:8000 --api-key KEY \\
        --repeats 3 --out lockout.jsonl

Client side only (any server, the code before the pacing too). Localhost only.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx

from specserve.bench import hostile
from specserve.bench.loadgen import PROMPTS
from specserve.bench.soak import fresh_request


def gauges(http: httpx.Client) -> dict[str, float]:
    """The /metrics gauges this check reads (a name the server does not have is left out)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "specserve:num_sequences_held", "specserve:kv_cache_blocks_used")
    out = {}
    for line in http.get("/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(http: httpx.Client, timeout: float) -> float:
    """Seconds until nothing runs or waits (at most `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        now = gauges(http)
        if not now["vllm:num_requests_running"] and not now["vllm:num_requests_waiting"]:
            break
        time.sleep(0.5)
    return round(time.monotonic() - start, 2)


def flood(url: str, key: str, model: str, streams: int, heads: int,
          tokens: int) -> list[socket.socket]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPTS[1]}],
                       "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    socks = []
    for _ in range(streams):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, hostile.RECEIVE_WINDOW)
        sock.connect(hostile.address(url))
        sock.sendall(hostile._head("POST", "/v1/chat/completions", key, len(body)) + body)
        socks.append(sock)
    for _ in range(heads):
        sock = socket.create_connection(hostile.address(url))
        sock.sendall(hostile._head("POST", "/v1/chat/completions", key, 1000) + b'{"model": ')
        socks.append(sock)
    return socks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", required=True)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fresh-address", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("lockout: localhost only")
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=args.url, headers=headers, timeout=60) as http, \
            open(args.out, "a") as out:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for repeat in range(args.repeats):
            idle_before = wait_idle(http, 600)
            socks = flood(args.url, args.api_key, model, args.streams, args.heads, args.tokens)
            time.sleep(args.settle)
            at_flood = gauges(http)
            outcome, waited = fresh_request(args.url, headers, model, PROMPTS[0],
                                            args.fresh_address)
            at_answer = gauges(http)
            for sock in socks:
                sock.close()
            idle_after = wait_idle(http, 900)
            row = {"label": args.label, "repeat": repeat, "fresh_outcome": outcome,
                   "fresh_wait_s": round(waited, 2), "settle_s": args.settle,
                   "at_flood": at_flood, "at_answer": at_answer,
                   "idle_before_s": idle_before, "idle_after_close_s": idle_after,
                   "blocks_after": gauges(http).get("specserve:kv_cache_blocks_used"),
                   "streams": args.streams, "heads": args.heads, "tokens": args.tokens,
                   "fresh_address": args.fresh_address}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
