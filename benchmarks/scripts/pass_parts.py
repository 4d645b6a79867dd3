"""Where a target pass's time goes, by the number of rows it verifies: the projections (qkv, o,
gate_up, down), the vocabulary head, the native glue calls (rms_norm, rope_store_attend,
silu_mul) and the rest, for one sequence after a cached prefix. Each figure is the mean of
`--repeats` passes, per pass, in milliseconds.

    python benchmarks/scripts/pass_parts.py [--rows 1 2 4 5 6 9] [--prefix 256] [--repeats 10]

`--draft MODEL` times the draft model's pass instead, as the default pair's drafter runs it (its
restricted vocabulary head included).

The timers wrap each projection from Python, so the pass runs step by step (the per-call native
path: the fused `decoder_pass` needs the projections' native forms). `fused_pass_ab.py` profiles
the fused pass, which the engine runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from specserve import LLM, kernels
from specserve.models import transformer


def pass_arguments(doc: str, rows: list[int], repeats: int) -> argparse.Namespace:
    """The options of a script that times one sequence's passes (this one's, with defaults)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", type=int, nargs="+", default=rows)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--draft", default=None, help="time this draft model's pass (beside --model)")
    return p.parse_args()


def runner_of(args: argparse.Namespace):
    """The model runner whose passes are timed: the target's, or (`--draft`) the draft's, as
    the default pair's drafter runs it (its restricted head included). Two threads."""
    torch.set_num_threads(2)
    if args.draft is None:
        return LLM(args.model).engine.runner
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4}
    return LLM(args.model, speculative_config=spec).engine.spec.model.runner


def main() -> None:
    args = pass_arguments(__doc__, [1, 2, 4, 5, 6, 9], 10)
    runner = runner_of(args)
    spent: collections.Counter = collections.Counter()

    def timed(name, fn):
        def call(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            spent[name] += time.perf_counter() - start
            return out
        return call

    class Timed:  # a projection with its call and its `into` (the native pass's) timed
        def __init__(self, name, linear) -> None:
            self.call = timed(name, linear)
            if hasattr(linear, "into"):
                self.into = timed(name, linear.into)

        def __call__(self, *a, **kw):
            return self.call(*a, **kw)

    class Glue:  # the attention library with every call timed
        def __init__(self, lib) -> None:
            self.lib = lib

        def __getattr__(self, name):
            return timed(name, getattr(self.lib, name))

    native = kernels.attention
    transformer.kernels.attention = lambda: Glue(native())
    for layer in runner.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, Timed(name, getattr(layer, name)))
    if runner.head is not None:
        runner.head = timed("head", runner.head)
    else:
        runner.model.lm_head = timed("head", runner.model.lm_head)
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    assert blocks.reserve(table, args.prefix + max(args.rows))
    runner.forward([torch.randint(0, vocab, (args.prefix,), generator=g).tolist()], [0], [table], [1])
    result = {}
    for rows in args.rows:
        tokens = torch.randint(0, vocab, (rows,), generator=g).tolist()
        runner.forward([tokens], [args.prefix], [table])  # warm-up
        spent.clear()
        start = time.perf_counter()
        for _ in range(args.repeats):
            runner.forward([tokens], [args.prefix], [table])
        total = (time.perf_counter() - start) / args.repeats
        parts = {k: 1e3 * v / args.repeats for k, v in spent.items()}
        parts["other"] = 1e3 * total - sum(parts.values())
        result[rows] = {"total_ms": round(1e3 * total, 2), **{k: round(v, 2) for k, v in parts.items()}}
        print(rows, json.dumps(result[rows]), flush=True)


if __name__ == "__main__":
    main()
