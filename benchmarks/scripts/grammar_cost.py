"""What structured outputs cost per request and per token, on the default target's vocabulary
(Qwen2.5, 151,665 tokens, logits 151,936 wide), through `specserve.sampling.grammar` only.

For each of ten realistic specs (tool calls, extraction with nested objects, arrays and enums,
a recursive tree, json_object, two regexes, a choice list, a Qwen tool call as text around
JSON): compile time (the compile cache off), then, walking a valid output token by token,
the time of `allowed()` (the bool mask the sampler needs), `accept`, `forced(16)`,
`masks(next k tokens)` for k = 4, 8, 16, and `rollback(n)` for n = 1, 4, 16: each figure the
CPU time of the calling thread (the work itself; wall time with `--clock wall`). Walks on a
freshly compiled grammar (cold: the lexer states it needs are built as it goes) and on one
walked before (warm) are reported apart.
Also how many output tokens of the tool calls the grammar forces: the single legal token
(kind a) or its forced text's tokens (kind b, llguidance's fast-forward tokens).

    python benchmarks/scripts/grammar_cost.py [--reps 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

from specserve.hub.registry import resolve_model
from specserve.models.tokenizer import from_gguf_metadata
from specserve.sampling.grammar import GrammarCompiler, GrammarMatcher
from specserve.sampling.structured import Structural, StructuredOutputsParams as Spec
from specserve.weights.gguf_loader import open_gguf, read_metadata

LOGITS = 151936
ARGS = {"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}
TOOL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": ARGS},
        "required": ["name", "arguments"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"], "additionalProperties": False}}, "required": ["name", "arguments"],
    "additionalProperties": False}
EXTRACT = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "address": {"type": "object", "properties": {"street": {"type": "string"},
                "city": {"type": "string"}, "country": {"enum": ["US", "FR", "DE", "JP"]}},
                "required": ["street", "city", "country"], "additionalProperties": False},
    "phones": {"type": "array", "items": {"type": "object", "properties": {
        "kind": {"enum": ["home", "work", "mobile"]}, "number": {"type": "string"}},
        "required": ["kind", "number"], "additionalProperties": False}},
    "vip": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "email", "address", "phones", "vip", "score"],
    "additionalProperties": False}
TREE = {"$defs": {"node": {"type": "object", "properties": {"label": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["label", "children"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}
BOOKS = {"type": "array", "minItems": 1, "maxItems": 10, "items": {"type": "object",
         "properties": {"title": {"type": "string", "maxLength": 60}, "year": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
         "required": ["title", "year", "tags"], "additionalProperties": False}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CASES = [  # name, spec, a valid output
    ("tool_call", Spec(json=TOOL), CALL),
    ("multi_tool", Spec(json={"anyOf": [SEARCH, TOOL]}),
     '{"name": "search", "arguments": {"query": "best pizza in Naples", "limit": 5}}'),
    ("extraction", Spec(json=EXTRACT), json.dumps({
        "name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
        "address": {"street": "12 St James's Square", "city": "London", "country": "FR"},
        "phones": [{"kind": "home", "number": "+44 20 7946 0958"},
                   {"kind": "mobile", "number": "07700 900123"}], "vip": True, "score": 98.25})),
    ("tree", Spec(json=TREE), json.dumps({"label": "root", "children": [
        {"label": "a", "children": []}, {"label": "b", "children": [
            {"label": "c", "children": []}]}]})),
    ("books", Spec(json=BOOKS), json.dumps([
        {"title": "The Left Hand of Darkness", "year": 1969, "tags": ["scifi", "classic"]},
        {"title": "Dune", "year": 1965, "tags": ["scifi"]}])),
    ("json_object", Spec(json_object=True), json.dumps({
        "answer": "The capital of France is Paris.", "confidence": 0.97,
        "sources": ["wikipedia", "britannica"], "nested": {"ok": True, "n": None}})),
    ("regex_date", Spec(regex=r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?"), "2024-03-15 09:30"),
    ("regex_email", Spec(regex=r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)"), "jane.doe_42@example.org"),
    ("choice", Spec(choice=["positive", "negative", "neutral", "mixed"]), "neutral"),
    ("qwen_tool_call", Spec(structural=Structural("<tool_call>\n", TOOL, "\n</tool_call>")),
     f"<tool_call>\n{CALL}\n</tool_call>"),
]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def timed(clock, fn, *args) -> tuple[float, object]:
    start = clock()
    out = fn(*args)
    return clock() - start, out


def walk(m: GrammarMatcher, ids: list[int], times: dict[str, list[float]], clock) -> None:
    """One valid output, token by token, timing each operation at each position."""
    for i, token in enumerate(ids):
        dt, allowed = timed(clock, m.allowed)
        times.setdefault("allowed", []).append(dt)
        assert allowed[token], (i, token)
        for k in (4, 8, 16):
            times.setdefault(f"masks k={k}", []).append(timed(clock, m.masks, ids[i:i + k])[0])
        times.setdefault("forced(16)", []).append(timed(clock, m.forced, 16)[0])
        dt, ok = timed(clock, m.accept, token)
        assert ok
        times.setdefault("accept", []).append(dt)
    for n in (1, 4, 16):
        undo = min(n, len(ids))
        times.setdefault(f"rollback {n}", []).append(timed(clock, m.rollback, undo)[0])
        assert all(m.accept(t) for t in ids[len(ids) - undo:])


def forced_kinds(m: GrammarMatcher, ids: list[int]) -> dict[str, int]:
    """Of the output's tokens: the single legal one (kind a); in `forced()` though others are
    legal (kind b); free. And the grammar as the only drafter: rounds of `forced(16)` drafts
    checked against the output (drafted and accepted tokens, rounds with a draft)."""
    kinds = {"a": 0, "b": 0, "free": 0}
    for token in ids:
        single = int(m.allowed().sum()) == 1
        kinds["a" if single else "b" if m.forced(1) == [token] else "free"] += 1
        assert m.accept(token)
    m.rollback(len(ids))
    drafted = rounds = at = 0
    while at < len(ids):
        draft = m.forced(16)
        pairs = zip(draft, ids[at:], strict=False)
        good = next((i for i, (d, t) in enumerate(pairs) if d != t), min(len(draft), len(ids) - at))
        drafted, rounds = drafted + good, rounds + bool(draft)
        step = ids[at:at + good + 1]  # the accepted drafts and the token the model samples
        assert all(m.accept(t) for t in step)
        at += len(step)
    return kinds | {"drafted_accepted": drafted, "rounds_with_a_draft": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="compiles (and cold walks) per spec")
    parser.add_argument("--warm", type=int, default=3, help="walks per compiled grammar after "
                        "its first (the lexer states it needs are built by then)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="cpu: this thread's CPU time (steady on a busy machine); wall")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    tok = from_gguf_metadata(read_metadata(open_gguf(resolve_model("qwen2.5-coder-1.5b"))))
    build, compiler = timed(time.perf_counter, GrammarCompiler, tok, LOGITS, 0)
    print(f"GrammarCompiler for {LOGITS} logits: {build:.2f} s (wall)")
    compile_s, cold, warm, rows, kinds = [], {}, {}, {}, {}
    for name, spec, text in CASES:
        ids = tok.encode(text)
        mine = [timed(clock, compiler.compile, spec) for _ in range(args.reps)]
        compile_s += [dt for dt, _ in mine]
        per = {}
        for _, grammar in mine:
            walk(grammar.matcher(), ids, cold, clock)
            for _ in range(args.warm):
                walk(grammar.matcher(), ids, per, clock)
        for key, xs in per.items():
            warm.setdefault(key, []).extend(xs)
        rows[name] = {"tokens": len(ids), "compile_ms_p50": 1e3 * pct([d for d, _ in mine], 50),
                      "compile_ms_max": 1e3 * max(d for d, _ in mine),
                      "allowed_us_p50": 1e6 * pct(per["allowed"], 50),
                      "allowed_us_p99": 1e6 * pct(per["allowed"], 99)}
        if "tool" in name:
            kinds[name] = forced_kinds(mine[0][1].matcher(), ids)
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in rows[name].items()})
    summary = {"compile_ms": [1e3 * pct(compile_s, 50), 1e3 * pct(compile_s, 99)]}
    for label, times in (("warm", warm), ("cold", cold)):
        summary |= {f"{label} {key} us": [1e6 * pct(xs, 50), 1e6 * pct(xs, 99)]
                    for key, xs in times.items()}
    for key, (p50, p99) in summary.items():
        print(f"{key:24s} p50 {p50:9.1f}  p99 {p99:9.1f}")
    print("forced kinds:", kinds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"clock": args.clock, "compiler_build_wall_s": build,
                       "summary_p50_p99": summary, "per_spec": rows, "forced_kinds": kinds}, f,
                      indent=1)


if __name__ == "__main__":
    main()
