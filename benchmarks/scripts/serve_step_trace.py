"""Where a busy server's time goes, step by step: `specserve serve` with every engine step
written to a JSON-lines file (decoding sequences B, rows, drafts per sequence, tokens each
gained, the pass's seconds and what the cost model predicted for it), then a summary by (B,
rows). A diagnosis tool: it wraps the engine's methods in this process only.

    python benchmarks/scripts/serve_step_trace.py serve --port 8201 [serve flags] \\
        --trace /tmp/steps.jsonl            # then drive it, e.g. with serve_ab.py
    python benchmarks/scripts/serve_step_trace.py summary /tmp/steps.jsonl
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time


def serve(argv: list[str]) -> int:
    from specserve.cli import main
    from specserve.engine.engine import LLMEngine
    from specserve.speculative.controller import SpeculationController

    i = argv.index("--trace")
    out = open(argv[i + 1], "w", buffering=1)
    argv = argv[:i] + argv[i + 2:]
    plan, run_pass, run_step = SpeculationController.plan, LLMEngine._pass, LLMEngine.step

    def traced_plan(self, seqs, max_rows=None):
        start = time.perf_counter()
        ks = plan(self, seqs, max_rows)
        self.trace_plan_s = time.perf_counter() - start
        self.trace_pass_s = self.cost.pass_time(len(seqs) + sum(ks.values()))
        return ks

    def traced_pass(self, step):
        before = [len(s.token_ids) for s in step.decode]
        start = time.perf_counter()
        run_pass(self, step)
        self.trace_record = {
            "B": len(step.decode), "ks": list(step.ks),
            "prefill_tokens": sum(c.num_tokens for c in step.chunks),
            "gained": [len(s.token_ids) - n for s, n in zip(step.decode, before)],
            "seconds": time.perf_counter() - start,
            "predicted_pass_s": getattr(self.spec, "trace_pass_s", None),
            "plan_s": getattr(self.spec, "trace_plan_s", 0.0)}

    def traced_step(self):  # the whole step: plan, schedule, pass, outputs
        self.trace_record = None
        start = time.perf_counter()
        deltas = run_step(self)
        if self.trace_record is not None:
            out.write(json.dumps({**self.trace_record, "step_start": start,
                                  "step_s": time.perf_counter() - start}) + "\n")
        return deltas

    SpeculationController.plan, LLMEngine._pass = traced_plan, traced_pass
    LLMEngine.step = traced_step
    return main(argv)


def summary(path: str) -> None:
    with open(path) as f:
        steps = [json.loads(line) for line in f]
    by_shape, by_batch = collections.defaultdict(list), collections.defaultdict(lambda: [0.0, 0])
    for s in steps:
        totals = by_batch[(s["B"], s["prefill_tokens"] > 0)]
        totals[0] += s["seconds"]
        totals[1] += sum(s["gained"])
        if not s["prefill_tokens"]:
            by_shape[(s["B"], s["B"] + sum(s["ks"]))].append(s)
    print("| B | rows | steps | median s | predicted s | tokens/step | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for (b, rows), group in sorted(by_shape.items()):
        seconds = statistics.median(s["seconds"] for s in group)
        predicted = [s["predicted_pass_s"] for s in group if s["predicted_pass_s"]]
        tokens = sum(sum(s["gained"]) for s in group) / len(group)
        print(f"| {b} | {rows} | {len(group)} | {seconds * 1e3:.1f} ms | "
              f"{statistics.median(predicted) * 1e3 if predicted else 0:.1f} ms | "
              f"{tokens:.2f} | {tokens / seconds:.1f} |")
    print("\n| B | steps | median step ms | pass ms | plan ms | gap to the next step ms |")
    print("|---|---|---|---|---|---|")
    by_b = collections.defaultdict(list)
    for s, nxt in zip(steps, steps[1:] + [None]):
        if "step_s" in s:
            gap = nxt["step_start"] - s["step_start"] - s["step_s"] if nxt else None
            by_b[s["B"]].append((s["step_s"], s["seconds"], s.get("plan_s") or 0.0, gap))
    for b, rows in sorted(by_b.items()):
        gaps = [g for *_, g in rows if g is not None and g < 0.5]  # not an idle wait
        print(f"| {b} | {len(rows)} | {statistics.median(r[0] for r in rows) * 1e3:.2f} | "
              f"{statistics.median(r[1] for r in rows) * 1e3:.2f} | "
              f"{statistics.mean(r[2] for r in rows) * 1e3:.3f} | "
              f"{statistics.mean(gaps) * 1e3 if gaps else 0:.3f} |")
    print("\n| B | with prefill | seconds in all | tokens | tokens/s |\n|---|---|---|---|---|")
    for (b, prefill), (seconds, tokens) in sorted(by_batch.items()):
        print(f"| {b} | {prefill} | {seconds:.1f} | {tokens} | {tokens / max(seconds, 1e-9):.1f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["summary"]:
        summary(sys.argv[2])
    else:
        sys.exit(serve(sys.argv[1:]))
