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
    from specserve.engine.runner import ModelRunner

    plan, run_pass, run_step = SpeculationController.plan, LLMEngine._pass, LLMEngine.step
    forward = ModelRunner.forward
    forward_s = [0.0]  # the target's forward passes (the draft model's too) in this step

    def traced_forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - start

    def traced_plan(self, seqs, max_rows=None):
        start = time.perf_counter()
        ks = plan(self, seqs, max_rows)
        self.trace_plan_s = time.perf_counter() - start
        self.trace_pass_s = self.cost.pass_time(len(seqs) + sum(ks.values()))
        return ks

    def traced_pass(self, step):
        before = [len(s.token_ids) for s in step.decode]
        forward_s[0] = 0.0
        start = time.perf_counter()
        run_pass(self, step)
        self.trace_record = {
            "B": len(step.decode), "ks": list(step.ks),
            "prefill_tokens": sum(c.num_tokens for c in step.chunks),
            "gained": [len(s.token_ids) - n for s, n in zip(step.decode, before)],
            "seconds": time.perf_counter() - start, "forward_s": forward_s[0],
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
    ModelRunner.forward = traced_forward
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
    print("\n| B | steps | median step ms | pass ms | forward ms | plan ms | "
          "gap to the next step ms |")
    print("|---|---|---|---|---|---|---|")
    by_b = collections.defaultdict(list)
    for s, nxt in zip(steps, steps[1:] + [None]):
        if "step_s" in s:
            gap = nxt["step_start"] - s["step_start"] - s["step_s"] if nxt else None
            by_b[s["B"]].append((s["step_s"], s["seconds"], s.get("plan_s") or 0.0, gap,
                                 s.get("forward_s") or 0.0))
    for b, rows in sorted(by_b.items()):
        gaps = [r[3] for r in rows if r[3] is not None and r[3] < 0.5]  # not an idle wait
        print(f"| {b} | {len(rows)} | {statistics.median(r[0] for r in rows) * 1e3:.2f} | "
              f"{statistics.median(r[1] for r in rows) * 1e3:.2f} | "
              f"{statistics.median(r[4] for r in rows) * 1e3:.2f} | "
              f"{statistics.mean(r[2] for r in rows) * 1e3:.3f} | "
              f"{statistics.mean(gaps) * 1e3 if gaps else 0:.3f} |")
    print("\n| B | with prefill | seconds in all | tokens | tokens/s |\n|---|---|---|---|---|")
    for (b, prefill), (seconds, tokens) in sorted(by_batch.items()):
        print(f"| {b} | {prefill} | {seconds:.1f} | {tokens} | {tokens / max(seconds, 1e-9):.1f} |")
    turns(steps)


def turns(steps: list[dict]) -> None:
    """The busiest batch's decode passes per stretch of load (steps split at idle gaps over
    a second: with servers taking turns, one turn each), by rows: the machine's speed moves
    between turns, so a pass is compared with the passes of its own turn."""
    busiest = max((s["B"] for s in steps), default=0)
    stretches = [steps[:1]]
    for a, b in zip(steps, steps[1:]):
        if b["step_start"] - a["step_start"] - a.get("step_s", a["seconds"]) > 1.0:
            stretches.append([])
        stretches[-1].append(b)
    print(f"\n| turn start s | steps | passes at B = {busiest}: rows, count, median forward ms, "
          "tokens/step, tokens/s |\n|---|---|---|")
    for group in stretches:
        full = [s for s in group if s["B"] == busiest and not s["prefill_tokens"]]
        cells = []
        for rows in sorted({busiest + sum(s["ks"]) for s in full}):
            g = [s for s in full if busiest + sum(s["ks"]) == rows]
            forward = statistics.median(s.get("forward_s") or s["seconds"] for s in g)
            tokens = statistics.mean(sum(s["gained"]) for s in g)
            cells.append(f"{rows}: {len(g)}, {forward * 1e3:.1f}, {tokens:.2f}, "
                         f"{tokens / forward:.0f}")
        print(f"| {group[0]['step_start'] - steps[0]['step_start']:.0f} | {len(group)} | "
              f"{'; '.join(cells)} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["summary"]:
        summary(sys.argv[2])
    else:
        sys.exit(serve(sys.argv[1:]))
