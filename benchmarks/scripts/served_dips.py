"""The dips of a server that has served: in each trial, on each server in turn (the order
alternated trial by trial), three requests of other traffic, then four identical code edits
sent at once, then one creative request at T = 0.7; streamed chat, EOS ignored, every trial
on new prompts. Start each server with `--trace-steps FILE`, then

    python benchmarks/scripts/served_dips.py run --ports 8201,8202 --names default,no-spec \\
        --trials 4 --out dips.jsonl
    python benchmarks/scripts/served_dips.py table dips.jsonl default=default.trace \\
        no-spec=nospec.trace

`table` splits each server's step trace into the phases (a phase starts with a prefill step
after a pause) and gives per phase: the wall time the client saw, the target's steps, and
the median time of the server's plain steps (no drafts, no prefill, at the phase's usual
batch), which is the machine's speed at that moment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from specserve.bench import sse
from specserve.bench.request_pool import distinct_pool

PHASES = ("other", "identical4", "creative")


def stream(port: int, text: str, max_tokens: int, temperature: float, seed: int = 0) -> dict:
    body = {"model": "qwen2.5-coder-1.5b", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn, resp = sse.post_stream(port, "/v1/chat/completions", body, timeout=3600)
    stats = None
    for event in sse.events(resp):
        if event != sse.DONE:
            stats = event.get("speculative_stats") or stats
    conn.close()
    return {"e2e": time.perf_counter() - t0, "stats": stats}


def at_once(port: int, jobs: list[tuple]) -> tuple[float, list[dict]]:
    out: list = [None] * len(jobs)

    def run(i: int) -> None:
        out[i] = stream(port, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def trial(port: int, k: int) -> dict:
    pool = distinct_pool("mixed-even")
    codes = [t for n, t in pool if n == "code_edit"]
    stories = [t for n, t in pool if n == "story"]
    res = {}
    res["other"] = at_once(port, [(t, 128, 0.0) for t in
                                  (stories[3 * k], stories[3 * k + 1], codes[k + 6])])[0]
    res["identical4"], outs = at_once(port, [(codes[k], 256, 0.0)] * 4)
    res["identical4_stats"] = [o["stats"] for o in outs]
    res["creative"], outs = at_once(port, [(stories[100 + k], 256, 0.7, k)])
    res["creative_stats"] = outs[0]["stats"]
    return res


def run(args) -> None:
    ports, names = [int(p) for p in args.ports.split(",")], args.names.split(",")
    if args.trials > 6:
        raise SystemExit("at most 6 trials: the pool has 12 code edits")
    with open(args.out, "a") as log:
        for k in range(args.trials):
            order = list(range(len(ports)))[::-1 if k % 2 else 1]
            for i in order:
                r = trial(ports[i], k)
                r.update(server=names[i], trial=k)
                log.write(json.dumps(r) + "\n")
                log.flush()
                print(names[i], k, *(round(r[p], 1) for p in PHASES), flush=True)


def phases(path: str, count: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in open(path)]
    out: list[list[dict]] = []
    for j, r in enumerate(rows):
        gap = r["t"] - (rows[j - 1]["t"] + rows[j - 1]["step_s"]) if j else 1.0
        if r["prefill_tokens"] and gap > 0.003:
            out.append([])
        out[-1].append(r)
    return out[:count]


def table(args) -> None:
    trials = [json.loads(line) for line in open(args.log)]
    traces = dict(t.split("=", 1) for t in args.traces)
    cells = {}
    for name, path in traces.items():
        mine = sorted((t for t in trials if t["server"] == name), key=lambda t: t["trial"])
        for j, steps in enumerate(phases(path, 3 * len(mine))):
            k, phase = j // 3, PHASES[j % 3]
            decode = [r for r in steps if not r["prefill_tokens"]]
            batch = statistics.median_low([r["B"] for r in decode])
            plain = [r["step_s"] for r in decode if not sum(r.get("k", [])) and r["B"] == batch]
            cells[(k, name, phase)] = {
                "wall": mine[k][phase], "steps": len(steps),
                "tokens": sum(sum(r["gained"]) for r in steps),
                "plain_ms": 1000 * statistics.median(plain) if plain else None,
                "drafted": sum(sum(r.get("k", [])) for r in steps),
                "accepted": sum(sum(r.get("accepted", [])) for r in steps)}
    a, b = list(traces)
    print(f"| trial | phase | tokens | {a}: wall s, steps, plain step ms | {b}: wall s, steps, "
          f"plain step ms | wall: {b} / {a} | steps: {b} / {a} | {a} accepted / drafted |")
    print("|---|---|---|---|---|---|---|---|")

    def fmt(c: dict) -> str:
        return f"{c['wall']:.1f}, {c['steps']}, " + (f"{c['plain_ms']:.0f}" if c["plain_ms"]
                                                       else "—")

    for k in sorted({key[0] for key in cells}):
        for phase in PHASES:
            x, y = cells[(k, a, phase)], cells[(k, b, phase)]
            print(f"| {k} | {phase} | {x['tokens']} | {fmt(x)} | {fmt(y)} | "
                  f"{y['wall'] / x['wall']:.2f} | {y['steps'] / x['steps']:.2f} | "
                  f"{x['accepted']}/{x['drafted']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--ports", required=True)
    r.add_argument("--names", required=True)
    r.add_argument("--trials", type=int, default=4)
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("log")
    t.add_argument("traces", nargs=2, help="NAME=TRACE for each of two servers")
    args = p.parse_args()
    (run if args.command == "run" else table)(args)


if __name__ == "__main__":
    main()
