"""Where a server's time went, from its step trace (`specserve serve --trace-steps FILE`).

    python benchmarks/scripts/step_trace_summary.py FILE [--since T0] [--until T1]

Tables: decode passes by (batch B, rows), with their median seconds against the cost model's
prediction and the tokens they gained; drafts and acceptance by source; why sequences drafted
nothing; and the steps that shared their pass with prefill chunks.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def load(path: str, since: float | None, until: float | None) -> list[dict]:
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return [s for s in steps if (since is None or s["t"] >= since)
            and (until is None or s["t"] <= until)]


def by_shape(steps: list[dict]) -> None:
    shapes = collections.defaultdict(list)
    for s in steps:
        if s["B"] and not s["prefill_tokens"]:
            shapes[(s["B"], s["B"] + sum(s["k"]))].append(s)
    print("| B | rows | steps | median verify ms | predicted ms | tokens/step | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for (b, rows), group in sorted(shapes.items()):
        seconds = statistics.median(s["verify_s"] + s["draft_s"] for s in group)
        predicted = [s["predicted_s"] for s in group if "predicted_s" in s]
        tokens = statistics.mean(sum(s["gained"]) for s in group)
        print(f"| {b} | {rows} | {len(group)} | {seconds * 1e3:.1f} | "
              f"{statistics.median(predicted) * 1e3 if predicted else float('nan'):.1f} | "
              f"{tokens:.2f} | {tokens / seconds:.1f} |")


def by_source(steps: list[dict]) -> None:
    drafted, kept, rounds = (collections.Counter() for _ in range(3))
    reasons = collections.Counter()
    for s in steps:
        for i, k in enumerate(s.get("k", [])):
            source = (s.get("source") or [None] * len(s["k"]))[i]
            if k:
                drafted[source] += k
                kept[source] += s["accepted"][i]
                rounds[source] += 1
            else:
                reasons[(s.get("reason") or [None] * len(s["k"]))[i]] += 1
    print("\n| source | rounds | drafted | accepted | acceptance |\n|---|---|---|---|---|")
    for source in sorted(drafted, key=str):
        print(f"| {source} | {rounds[source]} | {drafted[source]} | {kept[source]} | "
              f"{kept[source] / drafted[source]:.2f} |")
    print("\n| rounds without drafts, by reason | count |\n|---|---|")
    for reason, n in reasons.most_common():
        print(f"| {reason} | {n} |")


def with_prefill(steps: list[dict]) -> None:
    mixed = [s for s in steps if s["prefill_tokens"]]
    if not mixed:
        return
    print("\n| steps with prefill | prefill tokens | median step ms | decode rows |")
    print("|---|---|---|---|")
    print(f"| {len(mixed)} | {sum(s['prefill_tokens'] for s in mixed)} | "
          f"{statistics.median(s['step_s'] for s in mixed) * 1e3:.1f} | "
          f"{sum(s['B'] + sum(s['k']) for s in mixed)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--since", type=float, help="steps from this perf_counter time on")
    parser.add_argument("--until", type=float, help="steps up to this perf_counter time")
    args = parser.parse_args()
    steps = load(args.trace, args.since, args.until)
    print(f"{len(steps)} steps, {sum(sum(s.get('gained', [])) for s in steps)} tokens decoded, "
          f"{sum(s['step_s'] for s in steps):.1f} s in steps\n")
    by_shape(steps)
    by_source(steps)
    with_prefill(steps)


if __name__ == "__main__":
    main()
