# Run two OpenAI-compatible servers on the same model, then for example:
#   specserve serve --port 8201 &  specserve serve --port 8202 --no-speculation &
#   python benchmarks/scripts/serve_ab.py --ports 8201,8202 --clients 1 --rounds 6
# (any server with streamed /v1/chat/completions works as either side, llama-server included)
"""A/B of two running servers as their users see them: rounds of `clients` streamed chat
completions sent at once (the shipped prompts, each with a fresh prefix so that no prefix cache
serves it), the two servers alternated round by round (A B, then B A, ...). Per round and
server: total output tokens/s over the round's wall time, and each request's TTFT and end to end
time. The ratio is the median over rounds of A's total tokens/s over B's in the same pair of
rounds; one warm-up round per server is not counted."""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time

from specserve.bench import workloads

PROMPTS = ("code_edit", "creative", "summarize", "chat_short")


def stream(port: int, text: str, args, api_key: str | None) -> dict:
    """One streamed chat completion: output tokens, TTFT and end-to-end seconds."""
    body = {"model": args.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, tokens, pieces = None, 0, 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                pieces += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    return {"tokens": tokens or pieces, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0}


def one_round(port: int, texts: list[str], args, api_key: str | None) -> dict:
    results: list[dict | Exception] = [None] * len(texts)

    def work(i: int) -> None:
        try:
            results[i] = stream(port, texts[i], args, api_key)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ports", required=True, help="A,B")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--api-keys", default="", help="A's key,B's key (empty: none)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="shipped workloads, cycled")
    p.add_argument("--out", default=None, help="write every round here (JSON)")
    args = p.parse_args(argv)
    ports = [int(x) for x in args.ports.split(",")]
    keys = (args.api_keys.split(",") + ["", ""])[:2]
    names = args.prompts.split(",")
    texts = [workloads.load(n) for n in names]
    rounds = {port: [] for port in ports}
    for r in range(args.rounds + 1):  # round 0: warm-up
        for side in (ports if r % 2 == 0 else ports[::-1]):
            batch = [f"[{time.time_ns()}-{i}] " + texts[(r + i) % len(texts)]
                     for i in range(args.clients)]
            res = one_round(side, batch, args, keys[ports.index(side)] or None)
            res["round"], res["prompts"] = r, [names[(r + i) % len(names)]
                                               for i in range(args.clients)]
            if r:
                rounds[side].append(res)
            print(f"round {r} port {side}: {res['tokens_per_s']:.2f} tok/s, "
                  f"ttft {[round(q['ttft_s'] or 0, 2) for q in res['requests']]}", flush=True)
    a, b = ports
    ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rounds[a], rounds[b])]
    summary = {"clients": args.clients, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "rounds": args.rounds,
               "tokens_per_s": {str(port): statistics.median(x["tokens_per_s"] for x in rs)
                                for port, rs in rounds.items()},
               "ttft_s_median": {str(port): statistics.median(q["ttft_s"] for x in rs
                                                              for q in x["requests"])
                                 for port, rs in rounds.items()},
               "ratio_per_round": [round(x, 3) for x in ratios],
               "ratio_median": statistics.median(ratios)}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
