"""A bounded soak run against a running `specserve serve` on this machine: streaming clients
mixed with bad and hostile clients, then the server's own figures.

`python -m specserve.bench.soak --url http://127.0.0.1:8000 --api-key KEY --pid PID
--clients 16 --duration 600` keeps `clients` well-behaved streaming chat requests in flight
(as `loadgen.py` does; a 429 is retried after its `Retry-After`) while, unless `--calm`:
- one client sends, in turn, malformed JSON, a body beyond the size limit, a stream it leaves
  after a few chunks (a disconnect) and JSON nested past the depth bound (`hostile.deep`);
  another reads streams slowly;
- hostile clients (`hostile.py`) keep a stream they never read for `--stall-s` seconds, trickle
  a body a byte at a time, and open connections that send half a head and go silent;
- a burst client sends `--burst` requests at once every few seconds, enough to reach 429;
- a flood client (`--flood N`) opens N streams it never reads (`--flood-tokens` each) and N
  requests whose bodies never end, all at once, holds them `--stall-s` seconds, and again;
- `--agents` clients stream requests with a tool on the agents' wires, `/v1/responses` and
  `/v1/messages` in turn, and one client asks for tool-call-shaped output that stalled the
  old parser (`` ```{ `` `--storm-repeats` times per choice; `soak_agents.py`).
Throughout, a prober asks /health every half second, and a fresh client (a new connection,
a short chat request, from `--fresh-address` if given: another user) comes every
`--fresh-every` seconds: their worst latency and waits are figures of the run, in calm runs
too.
At the end it waits `--grace` seconds at most for the clients' last requests (on a slow or
loaded machine they may outlast the run: those still open are left uncounted, their number
given as `clients_unended`), then for the server to go idle, and prints one JSON object: requests served,
4xx, 429 and 5xx answers, lost requests (a connection error or a stream without `[DONE]`,
other than the deliberate disconnects), hostile connections the server still held past its
timeouts (`held`), the outcome of each kind of client (`outcomes`: e.g. `stalled:dropped`),
the well-behaved clients' p50/p99 latency, /health's worst and p99 latency, the fresh
clients' p50 and worst wait, the server's resident memory at the start and the end (from
/proc/PID/status, with --pid), and KV cache blocks in use after the run. The starting memory
is read `--warmup` seconds into the run, once the first requests have allocated what the
server keeps for good. Localhost only.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.bench import hostile, soak_agents, sse
from specserve.bench.loadgen import PROMPTS, _pct

OVERSIZED = 5 << 20  # beyond the default --max-request-bytes (4 MiB)
KV_TOUCHED = "specserve:kv_cache_touched_bytes"


@dataclass
class Tally:
    """Outcomes by `kind:outcome`, and the well-behaved clients' latencies."""

    outcomes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)  # /health latencies
    fresh: list[float] = field(default_factory=list)  # fresh clients' waits
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, outcome: str, latency: float | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind}:{outcome}"] += 1
            if latency is not None:
                self.latencies.append(latency)


def stream_once(http: httpx.Client, model: str, prompt: str, max_tokens: int,
                leave_after: int | None = None, pause_s: float = 0.0) -> str:
    """One streaming chat request: "ok", "4xx", "429", "5xx", "left" (we left early) or
    "lost"."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "stream": True}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return "429" if r.status_code == 429 else "5xx" if r.status_code >= 500 else "4xx"
            for i, event in enumerate(sse.events(r.iter_lines(), every_line=True)):
                if leave_after is not None and i >= leave_after:
                    return "left"
                if isinstance(event, dict) and "error" in event:
                    error = event["error"]
                    return "5xx" if error.get("type", "").endswith("server_error") \
                        or error.get("code") in ("engine_dead", "engine_error") else "4xx"
                if event == sse.DONE:
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


def fresh_request(url: str, headers: dict, model: str, prompt: str,
                  address: str | None = None) -> tuple[str, float]:
    """A fresh client: a new connection (from local `address`, if given), one short chat
    request; (outcome, its wait)."""
    start = time.monotonic()
    transport = httpx.HTTPTransport(local_address=address) if address else None
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600,
                          transport=transport) as http:
            r = http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8})
    except httpx.HTTPError:
        return "lost", time.monotonic() - start
    outcome = {200: "ok", 429: "429"}.get(r.status_code,
                                          "5xx" if r.status_code >= 500 else "4xx")
    return outcome, time.monotonic() - start


def burst_request(http: httpx.Client, model: str, prompt: str) -> str:
    try:
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
    except httpx.HTTPError:
        return "lost"
    return {200: "ok", 429: "429"}.get(r.status_code, "5xx" if r.status_code >= 500 else "4xx")


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
        pid: int | None, seed: int = 0, warmup: float = 0.0, calm: bool = False,
        stall_s: float = 40.0, stall_tokens: int = 400, burst: int = 64, flood: int = 0,
        flood_tokens: int = 1500, fresh_every: float = 10.0, agents: int = 2,
        storm_repeats: int = 2000, fresh_address: str | None = None,
        grace: float = 300.0) -> dict:
    """The soak; the starting memory is read `warmup` seconds into the run (buffers the first
    requests allocate for good are not growth). `calm`: the well-behaved clients (and the
    probes) only."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tally = Tally()
    stop_at = time.monotonic() + duration
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    rss = {"start": rss_kib(pid), "kv_start": 0.0}

    def until_stopped(once) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            turn = 0
            while time.monotonic() < stop_at:
                once(http, turn)
                turn += 1

    def streaming(worker: int):
        def once(http, turn):
            start = time.monotonic()
            outcome = stream_once(http, model, PROMPTS[(worker + turn * clients) % len(PROMPTS)],
                                  max_tokens)
            tally.count("stream", outcome, time.monotonic() - start if outcome == "ok" else None)
            if outcome == "429":
                time.sleep(1.0)
        return lambda: until_stopped(once)

    def misbehaving(kinds: tuple[str, ...]):
        rng = random.Random(seed)

        def once(http, turn):
            kind = kinds[turn % len(kinds)]
            if kind in ("malformed", "oversized"):
                tally.count(kind, bad_request(http, model, kind))
            elif kind == "deep":
                tally.count(kind, hostile.deep(url, api_key, model, turn // len(kinds)))
            else:
                tally.count(kind, stream_once(http, model, rng.choice(PROMPTS), max_tokens,
                                              rng.randint(1, 4) if kind == "disconnect" else None,
                                              0.2 if kind == "slow" else 0.0))
        return lambda: until_stopped(once)

    def raw(kind: str, client):
        def loop():
            while time.monotonic() < stop_at:
                tally.count(kind, client())
        return loop

    def bursting(http, turn):
        with ThreadPoolExecutor(burst) as pool:
            for outcome in pool.map(lambda i: burst_request(http, model, PROMPTS[i % len(PROMPTS)]),
                                    range(burst)):
                tally.count("burst", outcome)
        time.sleep(5.0)

    def probe_health() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < stop_at:
                start = time.monotonic()
                try:
                    ok = http.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                with tally.lock:
                    tally.health.append(time.monotonic() - start)
                tally.count("health", "ok" if ok else "lost")
                time.sleep(0.5)

    def fresh_clients() -> None:
        rng = random.Random(seed + 1)
        while time.monotonic() < stop_at:
            outcome, waited = fresh_request(url, headers, model, rng.choice(PROMPTS),
                                            fresh_address)
            tally.count("fresh", outcome)
            if outcome == "ok":
                with tally.lock:
                    tally.fresh.append(waited)
            time.sleep(max(0.0, fresh_every - waited))

    def flooding() -> None:
        while time.monotonic() < stop_at:
            for outcome in hostile.flood(url, api_key, model, PROMPTS[1], flood, flood,
                                         flood_tokens, stall_s):
                tally.count("flood", outcome)

    def agent(worker: int):
        def once(http, turn):
            wire = soak_agents.WIRES[(worker + turn) % len(soak_agents.WIRES)]
            outcome = soak_agents.agent_request(http, wire, model,
                                                PROMPTS[(worker + turn) % len(PROMPTS)],
                                                max_tokens)
            tally.count(wire, outcome)
            if outcome == "429":
                time.sleep(1.0)
        return lambda: until_stopped(once)

    def storm(http, turn):
        outcome = soak_agents.tool_storm(http, model, storm_repeats, stream=turn % 2 == 1)
        tally.count("storm", outcome)
        if outcome == "429":
            time.sleep(1.0)

    def sample_after_warmup() -> None:
        time.sleep(min(warmup, duration))
        rss["start"] = rss_kib(pid)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            rss["kv_start"] = gauge(http, KV_TOUCHED)

    jobs = [streaming(w) for w in range(clients)] + [sample_after_warmup, probe_health,
                                                      fresh_clients]
    if not calm:
        jobs += [misbehaving(("malformed", "oversized", "disconnect", "deep")),
                 misbehaving(("slow",)),
                 raw("stalled", lambda: hostile.stalled_stream(
                     url, api_key, model, PROMPTS[0], stall_tokens, stall_s)),
                 raw("trickled", lambda: hostile.trickled_body(url, api_key, 0.5, stall_s)),
                 raw("half_open", lambda: hostile.half_open(url, stall_s)),
                 lambda: until_stopped(bursting)]
        jobs += [flooding] if flood else []
        jobs += [agent(w) for w in range(agents)]
        jobs += [lambda: until_stopped(storm)] if storm_repeats else []
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    give_up = stop_at + grace  # a client's last request may outlast the run: wait this long
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    unended = sum(t.is_alive() for t in threads)  # their requests are left open, uncounted
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        idle_by = time.monotonic() + 60
        while time.monotonic() < idle_by and (gauge(http, "vllm:num_requests_running")
                                             or gauge(http, "vllm:num_requests_waiting")):
            time.sleep(0.2)
        kv_blocks = gauge(http, "specserve:kv_cache_blocks_used")
        kv_end = gauge(http, KV_TOUCHED)
    with tally.lock:
        outcomes = Counter(tally.outcomes)
        latencies, health, fresh = (sorted(tally.latencies), sorted(tally.health),
                                    sorted(tally.fresh))
    figures = summary(outcomes, clients, duration, rss["start"], rss_kib(pid), kv_blocks,
                      rss["kv_start"], kv_end)
    figures["clients_unended"] = unended
    figures.update(latency_p50_s=_pct(latencies, 50), latency_p99_s=_pct(latencies, 99),
                   health_p99_s=_pct(health, 99),
                   health_worst_s=round(health[-1], 3) if health else None,
                   fresh_p50_s=_pct(fresh, 50),
                   fresh_worst_s=round(fresh[-1], 3) if fresh else None)
    return figures


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
            outcomes["slow:ok"] + outcomes["burst:ok"] + outcomes["fresh:ok"] +
            outcomes["responses:ok"] + outcomes["messages:ok"] + outcomes["storm:ok"],
            "answers_4xx": by_outcome["4xx"],
            "answers_429": by_outcome["429"] + by_outcome["refused"],
            "answers_5xx": by_outcome["5xx"], "lost": by_outcome["lost"],
            "held": by_outcome["held"], "left_early": by_outcome["left"],
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
    p.add_argument("--calm", action="store_true", help="well-behaved clients only (a baseline)")
    p.add_argument("--stall-s", type=float, default=40.0, help="seconds a stalled reader, a "
                   "trickled body or a half-open connection waits for the server to close it "
                   "(longer than its timeouts)")
    p.add_argument("--stall-tokens", type=int, default=400,
                   help="max_tokens of a stream that is never read")
    p.add_argument("--burst", type=int, default=64, help="requests sent at once every 5 s")
    p.add_argument("--flood", type=int, default=0, help="streams never read, and bodies that "
                   "never end, opened at once and held --stall-s seconds, again and again "
                   "(0: none)")
    p.add_argument("--flood-tokens", type=int, default=1500,
                   help="max_tokens of each stream of the flood")
    p.add_argument("--fresh-every", type=float, default=10.0,
                   help="seconds between fresh clients (a new connection, a short request)")
    p.add_argument("--agents", type=int, default=2, help="clients streaming requests with a "
                   "tool on /v1/responses and /v1/messages in turn")
    p.add_argument("--storm-repeats", type=int, default=2000, help="```{ forced this many "
                   "times in each choice of the tool-call-shaped output (0: none)")
    p.add_argument("--fresh-address", default=None, help="local address of the fresh clients "
                   "(e.g. 127.0.0.2: another user than the others, all from 127.0.0.1)")
    p.add_argument("--grace", type=float, default=300.0, help="seconds after --duration to "
                   "wait for the clients' last requests; those still open then are left "
                   "uncounted (`clients_unended`), and the server is not idle after")
    args = p.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("soak: localhost only")
    print(json.dumps(run(args.url, args.api_key, args.clients, args.duration, args.max_tokens,
                         args.pid, args.seed, args.warmup, args.calm, args.stall_s,
                         args.stall_tokens, args.burst, args.flood, args.flood_tokens,
                         args.fresh_every, args.agents, args.storm_repeats,
                         args.fresh_address, args.grace)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
