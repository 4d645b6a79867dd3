"""A small load generator for a running `specserve serve` (or any OpenAI-compatible server).

`python -m specserve.bench.loadgen --url http://127.0.0.1:8000 --concurrency 4 --duration 120`
keeps that many streaming chat requests in flight for the duration (each client sends its
next request when the previous one ends) and prints requests served, errors, p50/p95 TTFT and
latency, and total generated tokens per second, as one JSON object. Localhost use only: it
is a measurement tool, not a stress weapon.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from specserve.bench import sse

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in three sentences.",
    "Write a shell one-liner that counts the lines of every .py file in a folder.",
    "Refactor this loop into a list comprehension: result = []\nfor x in xs:\n    if x > 0:\n"
    "        result.append(x * 2)",
)


@dataclass
class Record:
    ttft: float | None
    latency: float
    tokens: int
    error: str | None = None


@dataclass
class Results:
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)


def one_request(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> Record:
    """One streaming chat request; tokens counted from the usage the server reports."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Record(None, time.perf_counter() - start, 0, f"HTTP {r.status_code}")
            for chunk in sse.events(r.iter_lines()):
                if chunk == sse.DONE:
                    continue
                if "error" in chunk:
                    return Record(ttft, time.perf_counter() - start, tokens, chunk["error"]["message"])
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Record(ttft, time.perf_counter() - start, tokens, repr(e))
    return Record(ttft, time.perf_counter() - start, tokens)


def run(url: str, model: str, concurrency: int, duration: float, max_tokens: int,
        api_key: str | None = None) -> dict:
    results = Results()
    stop_at = time.perf_counter() + duration
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(worker: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            i = worker
            while time.perf_counter() < stop_at:
                results.add(one_request(http, model, PROMPTS[i % len(PROMPTS)], max_tokens))
                i += concurrency

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(results.records, time.perf_counter() - start, concurrency)


def summary(records: list[Record], wall: float, concurrency: int) -> dict:
    ok = [r for r in records if r.error is None]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    latencies = sorted(r.latency for r in ok)
    return {"concurrency": concurrency, "wall_s": round(wall, 1), "requests": len(ok),
            "errors": len(records) - len(ok), "first_errors": [r.error for r in records if r.error][:3],
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p95_s": _pct(ttfts, 95),
            "latency_p50_s": _pct(latencies, 50), "latency_p95_s": _pct(latencies, 95),
            "generated_tokens": sum(r.tokens for r in ok),
            "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 2) if wall else None}


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 3)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--duration", type=float, default=120.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("loadgen: localhost only")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    print(json.dumps(run(args.url, model, args.concurrency, args.duration, args.max_tokens, args.api_key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
