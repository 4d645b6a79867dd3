"""Tool calls under `tool_choice: "auto"`, judged: running OpenAI-compatible servers get the
shipped function-calling set (`specserve/bench/tasks/function_calls.json`: 20 questions with one
fitting tool, 20 with the fitting tool among four, 20 no offered tool fits), greedy, and each
answer is scored.

    specserve serve --port 8201 &     # e.g. against the server of an older commit on 8202
    python benchmarks/scripts/tool_calls_auto.py --ports 8201,8202 --names new,old

Per server and kind: calls well formed (a declared name, arguments a JSON object valid against
the tool's schema), calls to names the request did not declare, and accuracy (single and
multiple: exactly one call, to the right tool, with the expected values of the arguments the
item names, strings compared without case; irrelevant: no call). Servers take the items in
turn, item by item.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from openai import OpenAI

KINDS = ("single", "multiple", "irrelevant")


def load() -> dict:
    text = resources.files("specserve.bench.tasks").joinpath("function_calls.json").read_text()
    return json.loads(text)


def valid(value, schema: dict) -> bool:
    """`value` against the set's simple schemas (object, string, enum, number, integer)."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return isinstance(value, dict) and set(schema.get("required", ())) <= set(value) \
            and set(value) <= set(props) and all(valid(v, props[k]) for k, v in value.items())
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def same(got, expected) -> bool:
    if isinstance(expected, str):
        return isinstance(got, str) and got.strip().lower() == expected.lower()
    return got == expected


def score(item: dict, calls: list[tuple[str, str]], tools: dict) -> dict:
    offered = set(item["tools"])
    formed, undeclared, args = 0, 0, []
    for name, arguments in calls:
        if name not in offered:
            undeclared += 1
            continue
        try:
            value = json.loads(arguments)
        except ValueError:
            continue
        if valid(value, tools[name]["parameters"]):
            formed += 1
            args.append((name, value))
    if item["call"] is None:
        right = not calls
    else:
        right = len(calls) == 1 and len(args) == 1 and args[0][0] == item["call"] and all(
            same(args[0][1].get(k), v) for k, v in item["arguments"].items())
    return {"calls": len(calls), "formed": formed, "undeclared": undeclared, "right": right}


def ask(client: OpenAI, model: str, item: dict, tools: dict, max_tokens: int) -> dict:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": item["question"]}],
        tools=[{"type": "function", "function": tools[n]} for n in item["tools"]],
        tool_choice="auto", temperature=0, max_tokens=max_tokens, seed=0)
    message = out.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return {"calls": calls, "content": message.content, "finish": out.choices[0].finish_reason}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", required=True, help="comma-separated server ports")
    parser.add_argument("--names", help="comma-separated names for the servers")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the `model` field sent")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="append every answer and its score to this JSON-lines file")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    names = args.names.split(",") if args.names else [str(p) for p in ports]
    clients = [OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="none", max_retries=0,
                      timeout=600) for p in ports]
    data = load()
    totals = {(n, k): {"items": 0, "calls": 0, "formed": 0, "undeclared": 0, "right": 0}
              for n in names for k in KINDS}
    for i, item in enumerate(data["items"]):
        order = list(range(len(ports)))
        order = order[i % len(order):] + order[:i % len(order)]
        for s in order:
            answer = ask(clients[s], args.model, item, data["tools"], args.max_tokens)
            result = score(item, answer["calls"], data["tools"])
            row = totals[(names[s], item["kind"])]
            row["items"] += 1
            for key in ("calls", "formed", "undeclared"):
                row[key] += result[key]
            row["right"] += result["right"]
            record = {"server": names[s], "id": item["id"], "answer": answer, **result}
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    print("\n| server | kind | accuracy | calls well formed | calls to undeclared names |\n"
          "|---|---|---|---|---|")
    for n in names:
        for k in KINDS:
            r = totals[(n, k)]
            print(f"| {n} | {k} | {r['right']}/{r['items']} | {r['formed']}/{r['calls']} | "
                  f"{r['undeclared']} |")


if __name__ == "__main__":
    main()
