"""The fused decoder pass (one native call per pass) against the per-call native path (a dozen
calls per layer from Python), side by side: for each row count, passes of one sequence after a
cached prefix, the two paths alternated pass by pass, medians in milliseconds, and the ratio.
Both paths give the same bits (tests/models/test_decoder_pass.py); this measures only time.
Each row count also gets the fused pass's own profile: its milliseconds per kind of step
(`decoder.STEPS`), the mean over its passes, and the rest of the forward (the head, Python).

    python benchmarks/scripts/fused_pass_ab.py [--model M] [--draft D] [--rows 1 2 5 9]
        [--prefix 256] [--repeats 30]

`--draft D` times the draft model D's pass instead, as the default pair's drafter runs it
(int4-all, its restricted vocabulary head).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pass_parts import pass_arguments, runner_of  # this folder's (the script's own path)

from specserve import kernels
from specserve.kernels.decoder import STEPS
from specserve.bench.runner import machine_info
from specserve.models.transformer import Transformer


def main() -> None:
    args = pass_arguments(__doc__, [1, 2, 5, 9], 30)
    runner = runner_of(args)
    fused_plan = Transformer._decoder_plan

    def path(fused: bool) -> None:
        Transformer._decoder_plan = fused_plan if fused else (lambda self: None)

    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    assert blocks.reserve(table, args.prefix + max(args.rows))
    runner.forward([torch.randint(0, vocab, (args.prefix,), generator=g).tolist()], [0], [table],
                   [1])
    result = {"isa": kernels.isa(), "model": args.model, "draft": args.draft,
              "prefix": args.prefix, "machine": machine_info("float32"), "rows": {}}
    for rows in args.rows:
        tokens = torch.randint(0, vocab, (rows,), generator=g).tolist()
        times = {True: [], False: []}
        profile = torch.zeros(len(STEPS), dtype=torch.float64)
        for i in range(2 * args.repeats + 2):
            fused = i % 2 == 0
            path(fused)
            runner.model.pass_profile = profile if fused and i >= 2 else None
            start = time.perf_counter()
            runner.forward([tokens], [args.prefix], [table])
            if i >= 2:  # one warm-up pass of each
                times[fused].append(1e3 * (time.perf_counter() - start))
        runner.model.pass_profile = None
        fused_ms, calls_ms = statistics.median(times[True]), statistics.median(times[False])
        steps = {name: round(1e3 * float(v) / args.repeats, 2) for name, v in zip(STEPS, profile)}
        steps["rest"] = round(statistics.mean(times[True]) - sum(steps.values()), 2)
        result["rows"][rows] = {"fused_ms": round(fused_ms, 2), "per_call_ms": round(calls_ms, 2),
                                "ratio": round(fused_ms / calls_ms, 3), "fused_steps": steps}
        print(rows, json.dumps(result["rows"][rows]), flush=True)
    path(True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
