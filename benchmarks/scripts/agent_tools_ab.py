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
parse and validate against the tool's schema. A server's speed-up is the median over rounds of
the baseline server's round time over its own (`--baseline`, default the first).

`--wires` sends each server's sessions over another API (`chat` by default; `responses`: the
OpenAI Responses API with the official client; `messages`: the Anthropic Messages API with the
official client): the same conversation, tools and sampling in each wire's shapes, so one
server can be run once per wire (`--ports 8201,8201,8201 --wires chat,responses,messages`).
Each row also counts the prompt tokens the prefix cache served and their share of all prompt
tokens (as the wire reports them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import anthropic
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


def turn(client, model: str, messages: list, max_tokens: int, choice: str, wire: str) -> dict:
    """One streamed request over `wire`: its tool calls (reassembled), content, TTFT, seconds
    and the prompt tokens the server's prefix cache served."""
    start = time.perf_counter()
    out = WIRES[wire](client, model, messages, max_tokens, choice)
    out["seconds"] = time.perf_counter() - start
    out["ttft"] = None if out["first"] is None else out["first"] - start
    return out


def chat_turn(client: OpenAI, model: str, messages: list, max_tokens: int, choice: str) -> dict:
    first, calls, content, cached, prompt = None, {}, "", 0, 0
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=max_tokens, stream=True, seed=0, parallel_tool_calls=False,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            if chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter()
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    return {"first": first, "calls": [calls[i] for i in sorted(calls)], "content": content,
            "cached": cached, "prompt": prompt}


def responses_turn(client: OpenAI, model: str, messages: list, max_tokens: int,
                   choice: str) -> dict:
    first, calls, content, cached, prompt = None, [], "", 0, 0
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    stream = client.responses.create(
        model=model, instructions=messages[0]["content"], input=_items(messages[1:]),
        tools=tools, tool_choice=choice, temperature=0, max_output_tokens=max_tokens,
        parallel_tool_calls=False, stream=True, extra_body={"seed": 0})
    for event in stream:
        if first is None and event.type in ("response.output_text.delta",
                                            "response.function_call_arguments.delta"):
            first = time.perf_counter()
        if event.type == "response.output_text.delta":
            content += event.delta
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            calls.append({"id": event.item.call_id, "name": event.item.name,
                          "arguments": event.item.arguments})
        elif event.type in ("response.completed", "response.incomplete"):
            cached = event.response.usage.input_tokens_details.cached_tokens
            prompt = event.response.usage.input_tokens
    return {"first": first, "calls": calls, "content": content, "cached": cached,
            "prompt": prompt}


def _items(messages: list) -> list:
    items = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
            continue
        if m.get("content"):
            items.append({"role": m["role"], "content": m["content"]})
        for c in m.get("tool_calls", ()):
            items.append({"type": "function_call", "call_id": c["id"],
                          "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
    return items


def messages_turn(client: anthropic.Anthropic, model: str, messages: list, max_tokens: int,
                  choice: str) -> dict:
    first, content = None, ""
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with client.messages.stream(
            model=model, system=messages[0]["content"], messages=_turns(messages[1:]),
            tools=tools, max_tokens=max_tokens, extra_body={"temperature": 0, "seed": 0},
            tool_choice={"type": "any" if choice == "required" else "auto",
                         "disable_parallel_tool_use": True}) as stream:
        for event in stream:
            if first is None and event.type == "content_block_delta":
                first = time.perf_counter()
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                content += event.delta.text
        final = stream.get_final_message()
    calls = [{"id": b.id, "name": b.name, "arguments": json.dumps(b.input)}
             for b in final.content if b.type == "tool_use"]
    return {"first": first, "calls": calls, "content": content,
            "cached": final.usage.cache_read_input_tokens or 0,
            "prompt": final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)}


def _turns(messages: list) -> list:
    turns: list = []
    for m in messages:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                     "content": m["content"]}
            if turns and turns[-1]["role"] == "user" and isinstance(turns[-1]["content"], list):
                turns[-1]["content"].append(block)
            else:
                turns.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])}
                       for c in m.get("tool_calls", ())]
            turns.append({"role": "assistant", "content": blocks or ""})
        else:
            turns.append({"role": m["role"], "content": m["content"]})
    return turns


WIRES = {"chat": chat_turn, "responses": responses_turn, "messages": messages_turn}


def client_for(wire: str, port: int):
    if wire == "messages":
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none",
                                   max_retries=0, timeout=3600)
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                  timeout=3600)


def session(port: int, model: str, name: str, index: int, max_tokens: int, choice: str,
            wire: str = "chat") -> dict:
    client = client_for(wire, port)
    spec = load_session(name)
    messages = [{"role": "system", "content": SYSTEM}]
    out = {"seconds": 0.0, "ttft": [], "calls": 0, "valid": 0, "requests": 0, "cached": 0,
           "prompt": 0,
           "names": []}
    for user in spec.turns:
        messages.append({"role": "user", "content": variant(user, index)})
        r = turn(client, model, messages, max_tokens, choice, wire)
        out["seconds"] += r["seconds"]
        out["ttft"].append(r["ttft"])
        out["requests"] += 1
        out["cached"] += r["cached"]
        out["prompt"] += r["prompt"]
        out["names"].append([c["name"] for c in r["calls"]])
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


def one_round(port: int, model: str, clients: int, first_index: int, max_tokens: int,
              choice: str, wire: str = "chat") -> dict:
    results: list = [None] * clients

    def run(i: int) -> None:
        index = first_index + i
        results[i] = session(port, model, SESSIONS[index % len(SESSIONS)], index, max_tokens,
                             choice, wire)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"wall": wall, "ttft": [x for r in results for x in r["ttft"] if x is not None],
            "requests": sum(r["requests"] for r in results),
            "calls": sum(r["calls"] for r in results), "valid": sum(r["valid"] for r in results),
            "cached": sum(r["cached"] for r in results),
            "prompt": sum(r["prompt"] for r in results), "names": [r["names"] for r in results]}


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
    parser.add_argument("--wires", help="comma-separated API per server: chat (default), "
                                        "responses, messages")
    parser.add_argument("--out", help="append every round's figures to this JSON-lines file")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    names = args.names.split(",") if args.names else [str(p) for p in ports]
    wires = args.wires.split(",") if args.wires else ["chat"] * len(ports)
    rows = {n: [] for n in names}
    for r in range(args.rounds + 1):
        order = list(range(len(ports)))
        order = order[r % len(order):] + order[:r % len(order)]
        index = 1 + args.variant_offset + r * args.clients  # every server gets the round's variants (0: the shipped
        for i in order:  # text, never timed); no server sees a variant twice
            res = one_round(ports[i], args.model, args.clients, index, args.max_tokens,
                            args.tool_choice, wires[i])
            res.update(server=names[i], wire=wires[i], round=r, clients=args.clients,
                       warmup=r == 0)
            print(json.dumps(res), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
            if r:
                rows[names[i]].append(res)
    baseline = args.baseline or names[0]
    base = rows[baseline]
    print(f"\n| server | wire | clients | median round s | speed-up over {baseline} | p50 TTFT s "
          "| tool calls valid | prompt tokens cached |\n|---|---|---|---|---|---|---|---|")
    for n in names:
        ratio = statistics.median(b["wall"] / x["wall"] for b, x in zip(base, rows[n]))
        ttft = statistics.median(t for x in rows[n] for t in x["ttft"])
        calls, valid = sum(x["calls"] for x in rows[n]), sum(x["valid"] for x in rows[n])
        requests = sum(x["requests"] for x in rows[n])
        cached, prompt = sum(x["cached"] for x in rows[n]), sum(x["prompt"] for x in rows[n])
        share = f" of {prompt} ({cached / prompt:.1%})" if prompt else ""
        wire = wires[names.index(n)]
        print(f"| {n} | {wire} | {args.clients} | "
              f"{statistics.median(x['wall'] for x in rows[n]):.1f} | {ratio:.2f}x | {ttft:.2f} | "
              f"{valid}/{requests} ({calls} calls) | {cached}{share} |")


if __name__ == "__main__":
    main()
