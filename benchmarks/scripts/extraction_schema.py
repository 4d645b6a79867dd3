"""Structured extraction: the shipped extraction tasks answered under strict JSON schemas.

    python benchmarks/scripts/extraction_schema.py [--rounds 3] [--out FILE]

Each task's schema is built from its answer (strings, integers, numbers, booleans, arrays of
strings; every key required, nothing else allowed). Per task and round, in rotated order,
greedy, with empty caches before every call: target only without a schema (the prompt alone
asks for JSON), target only with the schema, the default speculation (hybrid) with the
schema, the grammar source alone, and the default without grammar drafts. Reported per
configuration: valid JSON against the schema, accuracy (the benchmark's checker), decode
tokens/s (median), and the paired decode speed-up over target only with the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.bench.checkers import check
from specserve.bench.tasks import load_tasks

DRAFT = "qwen2.5-coder-0.5b"
HYBRID = {"method": "hybrid", "model": DRAFT, "num_speculative_tokens": -1}


def schema_of(answer: dict) -> dict:
    def of(value) -> dict:
        if isinstance(value, bool):
            return {"type": "boolean"}
        if isinstance(value, int):
            return {"type": "integer"}
        if isinstance(value, float):
            return {"type": "number"}
        if isinstance(value, list):
            return {"type": "array", "items": {"type": "string"}}
        return {"type": "string"}
    return {"type": "object", "properties": {k: of(v) for k, v in answer.items()},
            "required": list(answer), "additionalProperties": False}


def valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = schema["properties"]
    kinds = {"boolean": bool, "integer": int, "number": (int, float), "string": str,
             "array": list}
    return isinstance(value, dict) and list(value) == list(props) and all(
        isinstance(value[k], kinds[p["type"]]) and (p["type"] == "boolean" or
                                                    not isinstance(value[k], bool))
        for k, p in props.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="append every call's figures to this JSON-lines file")
    args = parser.parse_args()
    plain = LLM(speculative_config=None, kv_cache_memory=1 << 29)
    hybrid = LLM(speculative_config=HYBRID, kv_cache_memory=1 << 30)
    grammar = LLM(speculative_config={"method": "grammar", "num_speculative_tokens": -1},
                  kv_cache_memory=1 << 29)
    no_grammar = LLM(speculative_config={**HYBRID, "grammar_drafts": False},
                     kv_cache_memory=1 << 30)
    configs = {  # name -> (llm, schema)
        "target only, no schema": (plain, False),
        "target only": (plain, True),
        "default": (hybrid, True),
        "grammar source alone": (grammar, True),
        "default without grammar drafts": (no_grammar, True),
    }
    tasks = load_tasks(("extraction",))
    rows = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for t, task in enumerate(tasks):
            schema = schema_of(task.data["answer"])
            order = names[(r + t) % len(names):] + names[:(r + t) % len(names)]
            for name in order:
                llm, constrained = configs[name]
                llm.clear_caches()
                params = SamplingParams(
                    temperature=0.0, max_tokens=args.max_tokens,
                    structured_outputs=StructuredOutputsParams(json=schema) if constrained
                    else None)
                out = llm.chat([{"role": "user", "content": task.prompt}], params)[0].outputs[0]
                row = {"config": name, "task": task.id, "round": r,
                       "valid": valid(out.text, schema),
                       "correct": check(task, out.text).correct, "tokens": out.num_output_tokens,
                       "decode_tps": out.decode_tokens_per_s, "text": out.text}
                rows[name].append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    report(rows)


def report(rows: dict) -> None:
    base = {(x["task"], x["round"]): x for x in rows["target only"]}
    print("| configuration | valid | correct | decode tok/s (median) | decode vs target only "
          "with the schema (paired median) |\n|---|---|---|---|---|")
    for name, xs in rows.items():
        tps = [x["decode_tps"] for x in xs if x["decode_tps"]]
        paired = [x["decode_tps"] / base[(x["task"], x["round"])]["decode_tps"] for x in xs
                  if x["decode_tps"] and base[(x["task"], x["round"])]["decode_tps"]]
        print(f"| {name} | {sum(x['valid'] for x in xs)}/{len(xs)} | "
              f"{sum(x['correct'] for x in xs)}/{len(xs)} | "
              f"{statistics.median(tps):.1f} | {statistics.median(paired):.2f}x |")


if __name__ == "__main__":
    main()
