"""Coding-agent sessions sent as real tool calls to running OpenAI-compatible servers, compared.

    specserve serve --port 8201 &  specserve serve --port 8202 --no-speculation &
    llama-server -m MODEL.gguf --jinja --port 8203 &
    python benchmarks/scripts/agent_tools_ab.py --ports 8201,8202,8203 \\
        --names default,no-spec,llama-server --clients 1 --rounds 3

A session is one of the shipped agent sessions (`specserve.bench.workloads`), rewritten so no
two timed sessions repeat (identifiers renamed per variant, so no prompt or answer recurs);
each turn is a chat request with the session's four tools (`tools`, `tool_choice`), streamed,
and the conversation carries the model's tool calls and a `tool` result message into the next
turn, as an agent does (`tool_choice` "required" by default: the sessions ask for a call every
turn). In a round every server runs `clients` sessions at once (each client its own variant,
the same variants on every server), servers in rotated order; a warm-up round per server is not counted. Per
server: end-to-end seconds of a round, TTFT per request, and the share of tool calls that
parse and validate against the tool's schema, and the share of the round's prompt tokens its
prefix cache served (from the server's `/metrics`; llama-server has none: blank). A server's
speed-up is the median over rounds of the baseline server's round time over its own
(`--baseline`, default the first).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request

from openai import OpenAI

from specserve.bench.workloads import load_session

SESSIONS = ("agent_session", "agent_session_ledger")
SYSTEM = ("You are a coding agent working in a repository. You act only through the tools you "
          "are given: every reply is exactly one tool call. Copy \"old\" exactly from the file "
          "shown, including indentation; change nothing else.")


def tool(name: str, properties: dict, description: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties), "additionalProperties": False}}}


STRING = {"type": "string"}
TOOLS = [
    tool("read_file", {"path": STRING}, "Read a file."),
    tool("edit_file", {"path": STRING, "old": STRING, "new": STRING},
         "Replace the exact text `old` (whole lines copied from the file) by `new`."),
    tool("run_tests", {"path": STRING, "pattern": STRING}, "Run the tests matching a pattern."),
    tool("write_file", {"path": STRING, "content": STRING}, "Write a whole file."),
]
RENAMES = [  # word → alternatives; a variant picks one alternative per word
    ("Shelf", ["Bin", "Rack", "Slot", "Bay", "Crate"]),
    ("Warehouse", ["Depot", "Store", "Yard", "Hub", "Vault"]),
    ("Ledger", ["Book", "Journal", "Register", "Tally", "Record"]),
    ("Account", ["Wallet", "Purse", "Fund", "Pot", "Till"]),
    ("sku", ["code", "item", "part", "ref", "tag"]),
    ("amount", ["count", "units", "qty", "size", "volume"]),
    ("cents", ["pennies", "value", "sum", "money", "coins"]),
    ("history", ["log", "events", "trail", "journal_entries", "changes"]),
]


def variant(text: str, index: int) -> str:
    """`text` with the renames of variant `index` (0: the shipped text)."""
    if index == 0:
        return text
    rng = random.Random(index)
    for word, choices in RENAMES:
        text = text.replace(word, rng.choice(choices) + (str(index) if index > 4 else ""))
    return text


def valid_call(call: dict) -> bool:
    """The call names a tool and its arguments are a JSON object with exactly its keys, all
    strings."""
    spec = next((t["function"] for t in TOOLS if t["function"]["name"] == call["name"]), None)
    if spec is None:
        return False
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return False
    keys = spec["parameters"]["required"]
    return isinstance(args, dict) and sorted(args) == sorted(keys) and all(
        isinstance(args[k], str) for k in keys)


def turn(client: OpenAI, model: str, messages: list, max_tokens: int, choice: str) -> dict:
    """One streamed request: its tool calls (reassembled), content, TTFT and seconds."""
    start = time.perf_counter()
    first, calls, content = None, {}, ""
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=max_tokens, stream=True, seed=0, parallel_tool_calls=False)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter() - start
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    return {"seconds": time.perf_counter() - start, "ttft": first,
            "calls": [calls[i] for i in sorted(calls)], "content": content}


def session(port: int, model: str, name: str, index: int, max_tokens: int, choice: str) -> dict:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                    timeout=3600)
    spec = load_session(name)
    messages = [{"role": "system", "content": SYSTEM}]
    out = {"seconds": 0.0, "ttft": [], "calls": 0, "valid": 0, "requests": 0}
    for user in spec.turns:
        messages.append({"role": "user", "content": variant(user, index)})
        r = turn(client, model, messages, max_tokens, choice)
        out["seconds"] += r["seconds"]
        out["ttft"].append(r["ttft"])
        out["requests"] += 1
        out["calls"] += len(r["calls"])
        out["valid"] += sum(valid_call(c) for c in r["calls"])
        if not r["calls"]:  # no call: the agent goes on with the text as the answer
            messages.append({"role": "assistant", "content": r["content"]})
            continue
        messages.append({"role": "assistant", "content": r["content"] or None, "tool_calls": [
            {"id": c["id"] or f"call_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(r["calls"])]})
        for i, c in enumerate(r["calls"]):
            messages.append({"role": "tool", "tool_call_id": c["id"] or f"call_{i}",
                             "content": "ok: done"})
    return out


def prompt_counters(port: int) -> tuple[float, float] | None:
    """(prompt tokens served from the prefix cache, prompt tokens computed) so far, from the
    server's /metrics; None where it has no such counters."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    except OSError:
        return None
    values = {}
    for line in text.decode().splitlines():
        name, _, rest = line.partition("{")
        if name in ("specserve:prefix_cache_hit_tokens_total",
                    "specserve:prompt_tokens_computed_total"):
            values[name] = values.get(name, 0.0) + float(rest.rsplit(" ", 1)[-1])
    if len(values) != 2:
        return None
    return (values["specserve:prefix_cache_hit_tokens_total"],
            values["specserve:prompt_tokens_computed_total"])


def one_round(port: int, model: str, clients: int, first_index: int, max_tokens: int,
              choice: str) -> dict:
    results: list = [None] * clients
    before = prompt_counters(port)

    def run(i: int) -> None:
        index = first_index + i
        results[i] = session(port, model, SESSIONS[index % len(SESSIONS)], index, max_tokens,
                             choice)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = prompt_counters(port)
    hits = None if before is None or after is None else (after[0] - before[0],
                                                          after[1] - before[1])
    return {"wall": wall, "ttft": [x for r in results for x in r["ttft"] if x is not None],
            "requests": sum(r["requests"] for r in results),
            "calls": sum(r["calls"] for r in results), "valid": sum(r["valid"] for r in results),
            "prefix_hit_tokens": None if hits is None else hits[0],
            "prompt_tokens_computed": None if hits is None else hits[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", required=True, help="comma-separated server ports")
    parser.add_argument("--names", help="comma-separated names for the servers")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the `model` field sent")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--tool-choice", default="required", choices=("auto", "required"),
                        help="required (default): every turn is a call, as the sessions ask")
    parser.add_argument("--variant-offset", type=int, default=0,
                        help="start this many variants in (servers that served an earlier run)")
    parser.add_argument("--baseline", help="the server the speed-ups are over (default: first)")
    parser.add_argument("--out", help="append every round's figures to this JSON-lines file")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    names = args.names.split(",") if args.names else [str(p) for p in ports]
    rows = {n: [] for n in names}
    for r in range(args.rounds + 1):
        order = list(range(len(ports)))
        order = order[r % len(order):] + order[:r % len(order)]
        index = 1 + args.variant_offset + r * args.clients  # every server gets the round's variants (0: the shipped
        for i in order:  # text, never timed); no server sees a variant twice
            res = one_round(ports[i], args.model, args.clients, index, args.max_tokens,
                            args.tool_choice)
            res.update(server=names[i], round=r, clients=args.clients, warmup=r == 0)
            print(json.dumps(res), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
            if r:
                rows[names[i]].append(res)
    baseline = args.baseline or names[0]
    base = rows[baseline]
    print(f"\n| server | clients | median round s | speed-up over {baseline} | p50 TTFT s | "
          "tool calls valid | prefix-cache hits |\n|---|---|---|---|---|---|---|")
    for n in names:
        ratio = statistics.median(b["wall"] / x["wall"] for b, x in zip(base, rows[n]))
        ttft = statistics.median(t for x in rows[n] for t in x["ttft"])
        calls, valid = sum(x["calls"] for x in rows[n]), sum(x["valid"] for x in rows[n])
        requests = sum(x["requests"] for x in rows[n])
        print(f"| {n} | {args.clients} | {statistics.median(x['wall'] for x in rows[n]):.1f} | "
              f"{ratio:.2f}x | {ttft:.2f} | {valid}/{requests} ({calls} calls) | "
              f"{hit_share(rows[n])} |")


def hit_share(rounds: list[dict]) -> str:
    """The prompt tokens the prefix cache served over all prompt tokens, over the rounds."""
    if any(r["prefix_hit_tokens"] is None for r in rounds):
        return ""
    hits = sum(r["prefix_hit_tokens"] for r in rounds)
    total = hits + sum(r["prompt_tokens_computed"] for r in rounds)
    return f"{hits / total:.1%} of {total:.0f}" if total else ""


if __name__ == "__main__":
    main()
