"""A bounded soak run against a running `specserve serve` on this machine: streaming clients
mixed with bad clients, then the server's own figures.

`python -m specserve.server.soak --url http://127.0.0.1:8000 --api-key KEY --pid PID
--clients 16 --duration 600` keeps `clients` streaming chat requests in flight (as
`loadgen.py` does) while one more client keeps sending, in turn, malformed JSON, a body
beyond the server's size limit and a stream it leaves after a few chunks (a disconnect), and
another keeps reading streams slowly. At the end it waits for the server to go idle and prints one JSON
object: requests served, 4xx and 5xx answers, lost requests (a connection error or a stream
without `[DONE]`, other than the deliberate disconnects), the server's resident memory at
the start and the end (from /proc/PID/status, with --pid), and KV cache blocks in use after
the run. The starting memory is read `--warmup` seconds into the run, once the first
requests have allocated what the server keeps for good. Localhost only.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from specserve.server.loadgen import PROMPTS

OVERSIZED = 5 << 20  # beyond the default --max-request-bytes (4 MiB)
KV_TOUCHED = "specserve:kv_cache_touched_bytes"


def stream_once(http: httpx.Client, model: str, prompt: str, max_tokens: int,
                leave_after: int | None = None, pause_s: float = 0.0) -> str:
    """One streaming chat request: "ok", "4xx", "5xx", "left" (we left early) or "lost"."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return "5xx" if r.status_code >= 500 else "4xx"
            for i, line in enumerate(r.iter_lines()):
                if leave_after is not None and i >= leave_after:
                    return "left"
                if line.startswith("data: {") and '"error"' in line:
                    error = json.loads(line[6:]).get("error", {})
                    return "5xx" if error.get("type", "").endswith("server_error") \
                        or error.get("code") in ("engine_dead", "engine_error") else "4xx"
                if line == "data: [DONE]":
                    return "ok"
                time.sleep(pause_s)
    except httpx.HTTPError:
        return "lost"
    return "lost"


def bad_request(http: httpx.Client, model: str, kind: str) -> str:
    if kind == "malformed":
        r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                      headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/completions", content=b'{"model": "' + b"x" * OVERSIZED + b'"}',
                      headers={"content-type": "application/json"})
    return "5xx" if r.status_code >= 500 else "4xx" if r.status_code >= 400 else "ok"


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def gauge(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise ValueError(f"/metrics has no {name}")


def run(url: str, api_key: str | None, clients: int, duration: float, max_tokens: int,
        pid: int | None, seed: int = 0, warmup: float = 0.0) -> dict:
    """The soak; the starting memory is read `warmup` seconds into the run (buffers the first
    requests allocate for good are not growth)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop_at = time.monotonic() + duration
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    rss = {"start": rss_kib(pid), "kv_start": 0.0}

    def count(kind: str, outcome: str) -> None:
        with lock:
            outcomes[f"{kind}:{outcome}"] += 1

    def streaming(worker: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            i = worker
            while time.monotonic() < stop_at:
                count("stream", stream_once(http, model, PROMPTS[i % len(PROMPTS)], max_tokens))
                i += clients

    def misbehaving(kinds: tuple[str, ...]) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            turn = 0
            while time.monotonic() < stop_at:
                kind, turn = kinds[turn % len(kinds)], turn + 1
                if kind in ("malformed", "oversized"):
                    count(kind, bad_request(http, model, kind))
                else:
                    count(kind, stream_once(http, model, rng.choice(PROMPTS), max_tokens,
                                            rng.randint(1, 4) if kind == "disconnect" else None,
                                            0.2 if kind == "slow" else 0.0))

    def sample_after_warmup() -> None:
        time.sleep(min(warmup, duration))
        rss["start"] = rss_kib(pid)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            rss["kv_start"] = gauge(http, KV_TOUCHED)

    threads = [threading.Thread(target=streaming, args=(w,)) for w in range(clients)]
    threads.append(threading.Thread(target=sample_after_warmup))
    threads.append(threading.Thread(target=misbehaving, args=(("malformed", "oversized",
                                                              "disconnect"),)))
    threads.append(threading.Thread(target=misbehaving, args=(("slow",),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        idle_by = time.monotonic() + 30
        while time.monotonic() < idle_by and (gauge(http, "vllm:num_requests_running")
                                             or gauge(http, "vllm:num_requests_waiting")):
            time.sleep(0.2)
        kv_blocks = gauge(http, "specserve:kv_cache_blocks_used")
        kv_end = gauge(http, KV_TOUCHED)
    return summary(outcomes, clients, duration, rss["start"], rss_kib(pid), kv_blocks,
                   rss["kv_start"], kv_end)


def summary(outcomes: Counter, clients: int, duration: float, rss_start: int | None,
            rss_end: int | None, kv_blocks: float, kv_start: float = 0.0,
            kv_end: float = 0.0) -> dict:
    """The run's figures. Resident memory also counts the KV pools' blocks once taken (mapped
    lazily, at most the budget: a prefix cache keeping finished prompts fills them), so the
    change is given with and without those bytes."""
    by_outcome = Counter()
    for key, value in outcomes.items():
        by_outcome[key.split(":")[1]] += value
    return {"clients": clients, "duration_s": duration, "served": outcomes["stream:ok"] +
            outcomes["slow:ok"], "answers_4xx": by_outcome["4xx"], "answers_5xx": by_outcome["5xx"],
            "lost": by_outcome["lost"], "left_early": by_outcome["left"],
            "outcomes": dict(sorted(outcomes.items())), "rss_start_kib": rss_start,
            "rss_end_kib": rss_end, "rss_change": (round(rss_end / rss_start - 1, 4)
                                                   if rss_start and rss_end else None),
            "kv_touched_mib_start": round(kv_start / 2**20, 1),
            "kv_touched_mib_end": round(kv_end / 2**20, 1),
            "rss_change_excluding_kv": (
                round((rss_end - kv_end / 1024) / (rss_start - kv_start / 1024) - 1, 4)
                if rss_start and rss_end else None),
            "kv_blocks_in_use_after": int(kv_blocks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="the server's process id (for its memory)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=600.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds into the run at which the starting memory is read")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("soak: localhost only")
    print(json.dumps(run(args.url, args.api_key, args.clients, args.duration, args.max_tokens,
                         args.pid, args.seed, args.warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
