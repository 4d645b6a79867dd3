"""The step trace (`EngineConfig.trace_steps`): one JSON line per engine step, for diagnosis.

A line holds the step's start (perf_counter seconds) and length, the decoding batch `B`,
per decoding sequence its drafts `k`, their source (`suffix`, `ngram`, `draft_model`,
`grammar+suffix`, ... or null) and the controller's reason when it drafted none, how many
were accepted and how many tokens it gained, the prefill tokens that shared the pass, the
draft and verify seconds, and the cost model's prediction for the step (`predicted_s`).
`benchmarks/scripts/step_trace_summary.py` reads it.
"""

from __future__ import annotations

import json
import time


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the engine
        self._round: dict = {}

    def round(self, proposals, results, draft_s: float, verify_s: float) -> None:
        """What the step's round drafted and kept (before it is committed)."""
        self._round = {"k": [p.k for p in proposals],
                       "accepted": [r.num_accepted for r in results],
                       "gained": [len(r.tokens) for r in results],
                       "draft_s": round(draft_s, 6), "verify_s": round(verify_s, 6)}

    def step(self, engine, plan, start: float) -> None:
        record = {"t": round(start, 6), "step_s": round(time.perf_counter() - start, 6),
                  "B": len(plan.decode), "prefill_tokens": sum(c.num_tokens for c in plan.chunks),
                  "prefill_path": engine.runner.prefill.label(),
                  "running": len(engine.scheduler.running),
                  "waiting": len(engine.scheduler.waiting), **self._round}
        if engine.spec is not None and plan.decode:
            name = engine.spec.source_name
            record["source"] = [_source(s, name) if k else None
                                for s, k in zip(plan.decode, plan.ks)]
            record["reason"] = [None if k else s.spec.reason for s, k in zip(plan.decode, plan.ks)]
            cost = engine.spec.cost
            steps = max((k for s, k in zip(plan.decode, plan.ks)
                         if s.spec.source == "draft_model"), default=0)
            record["predicted_s"] = round(cost.draft_time(steps) + cost.pass_time(
                len(plan.decode) + sum(plan.ks)), 6)
        self._round = {}
        self._file.write(json.dumps(record) + "\n")


def _source(seq, lookup_name: str) -> str:
    st = seq.spec
    if st.source == "lookup":
        return f"grammar+{lookup_name}" if st.forced else lookup_name
    return st.source
