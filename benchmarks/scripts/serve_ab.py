# Run two OpenAI-compatible servers on the same model, then for example:
#   specserve serve --port 8201 &  specserve serve --port 8202 --no-speculation &
#   python benchmarks/scripts/serve_ab.py --ports 8201,8202 --clients 1 --rounds 6
# (any server with streamed /v1/chat/completions works as either side, llama-server included)
"""Running servers compared as their users see them: rounds of `clients` streamed chat
completions sent at once (the shipped prompts, each with a fresh prefix so that no prefix cache
serves it), every server once per round, the order rotated round by round (A B C, B C A, ...;
two servers: A B, B A). Per round and server: total output tokens/s over the round's wall time,
and each request's TTFT and end to end time. Each server's ratio is the median over rounds of
its total tokens/s over the first server's in the same round; one warm-up round per server is
not counted.

A round of a few prompts ends with its last reply, and before it the batch shrinks as clients
run out of prompts: a large part of such a round runs below `clients` sequences, so its
tokens/s is partly the speed of its slowest request. `--duration S` measures the steady state
instead: in each round a server gets S seconds of `clients` clients each sending its next
prompt as soon as its reply ends (the same prompt list for every server, in the same order);
only the tokens streamed between `--ramp` seconds and S count (a token's time is its chunk's
arrival; our servers' `origins` give each chunk's token count), and the replies still running
at S finish before the next server's turn, uncounted."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time

from specserve.bench import sse, workloads
from specserve.bench.request_pool import POOLS, distinct_pool

PROMPTS = ("code_edit", "creative", "summarize", "chat_short")


def request_tokens(args, index: int) -> int:
    """The max_tokens of the pool's prompt `index` (see --vary-tokens)."""
    if not args.vary_tokens:
        return args.max_tokens
    return max(1, round(args.max_tokens * (0.5 + random.Random(index).random())))


def temperature_of(args, index: int) -> float:
    """The temperature of the pool's prompt `index` (see --temperatures)."""
    if not args.temperatures:
        return args.temperature
    temps = [float(t) for t in args.temperatures.split(",")]
    return temps[index % len(temps)]


def by_class(rounds: dict, ports: list[int], labels: list[str]) -> dict:
    """Per class of prompt (name and temperature): each server's median end-to-end seconds
    and the median over its prompts of the reference's seconds over its own (the same prompts
    on every server, paired by position in the round)."""
    out: dict = {}
    ref = rounds[ports[0]]
    for label, port in zip(labels, ports):
        for x, y in zip(rounds[port], ref):
            for cls, q, base in zip(x["prompts"], x["requests"], y["requests"]):
                cell = out.setdefault(cls, {}).setdefault(label, {"e2e": [], "ratio": []})
                cell["e2e"].append(q["e2e_s"])
                cell["ratio"].append(base["e2e_s"] / q["e2e_s"])
    return {cls: {label: {"e2e_s_median": round(statistics.median(c["e2e"]), 2),
                          f"speedup_over_{labels[0]}": round(statistics.median(c["ratio"]), 3),
                          "n": len(c["e2e"])} for label, c in cells.items()}
            for cls, cells in out.items()}


def prompt_pool(which: str) -> list[tuple[str, str]]:
    """(name, text) prompts: the shipped workloads (their names, comma-separated), or one of
    `request_pool.POOLS` (distinct texts, see `distinct_pool`)."""
    if which in POOLS:
        return distinct_pool(which)
    return [(n, workloads.load(n)) for n in which.split(",")]


def stream(port: int, request: tuple[str, int], args, api_key: str | None,
           arrivals: list | None = None) -> dict:
    """One streamed chat completion of `request` (text, max_tokens): output tokens, TTFT and
    end-to-end seconds; with `arrivals`, each content chunk's (arrival time, tokens) is appended
    to it (the tokens from the chunk's `origins` where the server gives them, else 1)."""
    text, max_tokens, temperature = request
    body = {"model": args.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if arrivals is not None:
        body["return_token_origins"] = True
    t0 = time.perf_counter()
    conn, resp = sse.post_stream(port, "/v1/chat/completions", body, api_key)
    ttft, tokens, pieces, stats = None, 0, 0, None
    for event in sse.events(resp):
        if event == sse.DONE:
            continue
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("origins"):
                pieces += 1
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                if arrivals is not None:
                    arrivals.append((now, len(delta.get("origins") or ()) or 1))
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event.get("speculative_stats"):
            stats = event["speculative_stats"]
    conn.close()
    out = {"tokens": tokens or pieces, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0}
    if stats and stats.get("enabled"):  # what each source drafted and why rounds sat idle
        out["speculation"] = {key: stats.get(key) for key in ("rounds", "drafted", "accepted",
                                                                "by_source", "idle_rounds")}
    return out


def run_round(port: int, texts: list[tuple[str, int]], args, api_key: str | None,
              clients: int) -> dict:
    """`texts` served by `clients` clients, each sending the next one as soon as its previous
    reply ended (`clients` = len(texts): all at once)."""
    results: list = [None] * len(texts)
    lock, todo = threading.Lock(), iter(range(len(texts)))

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = stream(port, texts[i], args, api_key)
            except Exception as exc:  # noqa: BLE001 - reported below
                results[i] = exc

    threads = [threading.Thread(target=work) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    return {"wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "requests": results}


def run_window(port: int, texts: list[tuple[str, int]], args, api_key: str | None,
               clients: int) -> dict:
    """`clients` clients sending `texts` in order, each its next as soon as its reply ends,
    until `args.duration` seconds from the start; the tokens streamed from `args.ramp` s to
    the end count (the replies running then finish first, uncounted)."""
    arrivals: list = []
    results: list = []
    lock, todo = threading.Lock(), iter(texts)
    t0 = time.perf_counter()
    deadline, exhausted = t0 + args.duration, []

    def work() -> None:
        while time.perf_counter() < deadline:
            with lock:
                text = next(todo, None)
            if text is None:
                exhausted.append(time.perf_counter() - t0)
                return
            mine: list = []
            start = time.perf_counter() - t0
            try:
                res = stream(port, text, args, api_key, mine)
            except Exception as exc:  # noqa: BLE001 - reported below
                res = exc
            with lock:
                arrivals.extend(mine)
                results.append(res if isinstance(res, Exception) else {**res, "start_s": start})

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise errors[0]
    if exhausted:
        raise RuntimeError(f"port {port}: the round's {len(texts)} prompts ran out "
                           f"{min(exhausted):.1f} s in: raise --queue")
    counted = sum(n for t, n in arrivals if t0 + args.ramp <= t < deadline)
    return {"wall_s": time.perf_counter() - t0, "counted_tokens": counted,
            "tokens_per_s": counted / (args.duration - args.ramp),
            "requests": [r for r in results if r["start_s"] < args.duration]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ports", required=True, help="A,B[,C...]: A is the reference")
    p.add_argument("--names", default=None, help="a name per port, for the report")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--vary-tokens", action="store_true",
                   help="each prompt's max_tokens drawn from 0.5-1.5x --max-tokens (fixed per "
                        "prompt, the same for every server): with one length for all, the "
                        "requests of a server that does not speculate run in lockstep, finish "
                        "together and prefill their successors together, as real traffic does not")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", default=None,
                   help="comma-separated temperatures given to the prompts in turn (fixed per "
                        "prompt, the same for every server; default: --temperature for all); "
                        "the report then gives each class of prompt and temperature its own "
                        "end-to-end ratio")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--api-keys", default="", help="a key per port, comma-separated (empty: none)")
    p.add_argument("--prompts", default=",".join(PROMPTS),
                   help='shipped workloads (cycled), "mixed", "mixed-even" or "stories" (distinct '
                        'prompts, see prompt_pool)')
    p.add_argument("--queue", type=int, default=0,
                   help="a round is this many prompts through the clients, each client sending "
                        "its next as soon as its reply ends (0: one prompt per client at once; "
                        "with --duration: 32, the prompts a round may use)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="sustained rounds: each server's turn is this many seconds of load, "
                        "tokens counted from --ramp to the end (0: rounds of --queue prompts)")
    p.add_argument("--ramp", type=float, default=5.0,
                   help="--duration: seconds from a turn's start before tokens count (the "
                        "clients start together, so the first prefills coincide)")
    p.add_argument("--offset", type=int, default=0,
                   help="mixed, stories: start this far into the pool (a run against servers that "
                        "served an earlier one: the default's shared suffix cache holds the "
                        "answers to the pool's first prompts and would draft them back)")
    p.add_argument("--out", default=None, help="write every round here (JSON)")
    args = p.parse_args(argv)
    ports = [int(x) for x in args.ports.split(",")]
    keys = (args.api_keys.split(",") + [""] * len(ports))[:len(ports)]
    labels = args.names.split(",") if args.names else [str(port) for port in ports]
    pool = prompt_pool(args.prompts)
    names, texts = [n for n, _ in pool], [t for _, t in pool]
    per_round = args.queue or (32 if args.duration else args.clients)
    if args.duration and args.duration <= args.ramp:
        p.error("--duration must exceed --ramp")
    distinct = args.prompts in POOLS
    if distinct and args.offset + (args.rounds + 1) * per_round > len(pool):
        p.error(f"{args.prompts}: {len(pool)} distinct prompts, fewer than the offset + "
                f"(rounds + 1) x the round's")
    rounds = {port: [] for port in ports}
    for r in range(args.rounds + 1):  # round 0: warm-up
        order = ports[r % len(ports):] + ports[:r % len(ports)]
        for side in order:
            at = args.offset + r * per_round if distinct else r  # mixed, stories: never repeated
            batch = [(f"[{time.time_ns()}-{i}] " + texts[(at + i) % len(texts)],
                      request_tokens(args, (at + i) % len(texts)), temperature_of(args, at + i))
                     for i in range(per_round)]
            run = run_window if args.duration else run_round
            res = run(side, batch, args, keys[ports.index(side)] or None, args.clients)
            res["round"], res["prompts"] = r, [
                f"{names[(at + i) % len(names)]}@T{temperature_of(args, at + i):g}"
                for i in range(per_round)]
            if r:
                rounds[side].append(res)
            print(f"round {r} {labels[ports.index(side)]}: {res['tokens_per_s']:.2f} tok/s, "
                  f"ttft {[round(q['ttft_s'] or 0, 2) for q in res['requests']]}", flush=True)
    ref = rounds[ports[0]]
    summary = {"clients": args.clients, "queue": args.queue, "offset": args.offset,
               "duration_s": args.duration, "ramp_s": args.ramp, "prompts": args.prompts,
               "max_tokens": args.max_tokens, "vary_tokens": args.vary_tokens,
               "temperature": args.temperature, "rounds": args.rounds, "servers": {}}
    for label, port in zip(labels, ports):
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rounds[port], ref)]
        summary["servers"][label] = {
            "port": port,
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds[port]),
            "ttft_s_median": statistics.median(q["ttft_s"] for x in rounds[port]
                                               for q in x["requests"]),
            "e2e_s_median": statistics.median(q["e2e_s"] for x in rounds[port]
                                              for q in x["requests"]),
            f"vs_{labels[0]}_per_round": [round(x, 3) for x in ratios],
            f"vs_{labels[0]}": statistics.median(ratios)}
    if not args.duration:
        summary["classes"] = by_class(rounds, ports, labels)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary,
                       "rounds": {label: rounds[port] for label, port in zip(labels, ports)}},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
