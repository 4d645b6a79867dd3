"""Where a pass stands against the machine's limits, ours against llama.cpp in one process,
interleaved measurement by measurement (a shared host drifts):

- decode: one-row passes after a cached context of 64, 1024 and 2048 tokens (tokens/s, and the
  fraction of the memory ceiling: read bandwidth / bytes a step reads at that context);
- verify: passes of 1..9 rows after a 256-token context, over the one-row pass;
- prefill: a 512- and a 1024-token prompt from an empty cache (tokens/s, and the fraction of
  the integer dot-product peak `dot_peak.c` measured, given with --peak MACS_PER_S: one
  multiply-add per weight of the projections and the head per token).

    python benchmarks/scripts/roofline.py [--repeats 7] [--peak 1.2e12] [--out FILE.json]

Needs `llama-cpp-python` (built natively) for the peer's columns; both use 2 threads and the
int4 target (the Q4_K_M file; ours with `weights="auto"`, float16 KV cache; theirs float16 KV).
Each figure is the median of `repeats` timings (a decode timing: the median of 3 passes in a
row, for both engines); llama.cpp's passes are `Llama.eval` calls, which also copy the last
row's logits out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve import kernels
from specserve.bench.bandwidth import ceiling, read_bandwidth
from specserve.speculative.calibration import median_round_robin, pass_timer
from specserve.llm import LLM
from specserve.weights.loader import load_model

TARGET = "qwen2.5-coder-1.5b"
THREADS = 2
CONTEXTS = (64, 1024, 2048)
VERIFY_CONTEXT = 256
VERIFY_ROWS = range(1, 10)
PREFILLS = (512, 1024)


def matmul_weights(model) -> int:
    """Weights one token multiplies: every projection and the head."""
    c = model.cfg
    per_layer = c.hidden_size * (c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim) \
        + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def ours_timers(llm: LLM, stack):
    runner = llm.engine.runner
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    timers = {}
    for ctx in CONTEXTS:
        step = stack.enter_context(pass_timer(runner, ctx, max_rows=16))
        # the median of 3 passes in a row, as the peer's decode timer takes
        timers[("decode", ctx)] = lambda step=step: statistics.median(step(0) for _ in range(3))
    verify = stack.enter_context(pass_timer(runner, VERIFY_CONTEXT, max_rows=16))
    for rows in VERIFY_ROWS:
        timers[("verify", rows)] = lambda verify=verify, rows=rows: verify(rows - 1)
    blocks = runner.block_manager(prefix_caching=False)
    for n in PREFILLS:
        table = blocks.new_table()
        assert blocks.reserve(table, n)
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()

        def prefill(tokens=tokens, table=table) -> float:
            start = time.perf_counter()
            runner.forward([tokens], [0], [table], [1])
            return time.perf_counter() - start
        timers[("prefill", n)] = prefill
    return timers


def theirs_timers(path: str, vocab: int):
    from llama_cpp import Llama

    n_ctx = max(max(CONTEXTS), max(PREFILLS)) + 32
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=THREADS, n_threads_batch=THREADS,
                n_batch=max(PREFILLS), n_ubatch=512, verbose=False)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, vocab, (n_ctx,), generator=g).tolist()

    def at(ctx: int, rows: int) -> float:  # rows new positions after ctx cached ones
        llm.n_tokens = ctx  # eval drops the cached positions from n_tokens on
        start = time.perf_counter()
        llm.eval(prefix[ctx:ctx + rows])
        return time.perf_counter() - start

    def fill(ctx: int) -> None:
        llm.reset()
        llm.eval(prefix[:ctx])

    timers = {}
    for ctx in CONTEXTS:
        def decode(ctx=ctx) -> float:
            fill(ctx)
            return statistics.median(at(ctx, 1) for _ in range(3))
        timers[("decode", ctx)] = decode
    for rows in VERIFY_ROWS:
        def verify(rows=rows) -> float:
            if llm.n_tokens < VERIFY_CONTEXT:
                fill(VERIFY_CONTEXT)
            return at(VERIFY_CONTEXT, rows)
        timers[("verify", rows)] = verify
    for n in PREFILLS:
        def prefill(n=n) -> float:
            llm.reset()
            start = time.perf_counter()
            llm.eval(prefix[:n])
            return time.perf_counter() - start
        timers[("prefill", n)] = prefill
    return timers


def main() -> None:
    from contextlib import ExitStack

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--peak", type=float, default=None, help="integer multiply-adds/s (dot_peak.c)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(THREADS)
    target = load_model(TARGET)
    llm = LLM(target, max_model_len=4096)
    model = llm.engine.runner.model
    with ExitStack() as stack:
        timers = {("ours",) + k: t for k, t in ours_timers(llm, stack).items()}
        if not args.no_peer:
            theirs = theirs_timers(str(target.path), model.cfg.vocab_size)
            timers.update({("llama.cpp",) + k: t for k, t in theirs.items()})
        for t in timers.values():  # warm-up
            t()
        bandwidth = read_bandwidth()
        med = median_round_robin(timers, args.repeats)
    kv = llm.engine.runner.cache.dtype
    engines = ["ours"] + ([] if args.no_peer else ["llama.cpp"])
    rows = []
    for ctx in CONTEXTS:
        ceil = ceiling(model, bandwidth, ctx, kv)["ceiling_tokens_per_s"]
        row = {"what": "decode", "context": ctx, "ceiling_tokens_per_s": ceil}
        for e in engines:
            row[f"{e}_tokens_per_s"] = 1 / med[(e, "decode", ctx)]
            row[f"{e}_fraction_of_ceiling"] = row[f"{e}_tokens_per_s"] / ceil
        rows.append(row)
    for n in VERIFY_ROWS:
        row = {"what": "verify", "rows": n}
        for e in engines:
            row[f"{e}_ms"] = 1e3 * med[(e, "verify", n)]
            row[f"{e}_over_one_row"] = med[(e, "verify", n)] / med[(e, "verify", 1)]
        rows.append(row)
    macs = matmul_weights(model)
    for n in PREFILLS:
        row = {"what": "prefill", "tokens": n}
        for e in engines:
            row[f"{e}_tokens_per_s"] = n / med[(e, "prefill", n)]
            if args.peak:
                row[f"{e}_fraction_of_peak"] = row[f"{e}_tokens_per_s"] * macs / args.peak
        rows.append(row)
    info = {"isa": kernels.isa(), "kv_cache_dtype": str(kv), "threads": THREADS, "read_bandwidth_gbs": bandwidth / 1e9,
            "peak_macs_per_s": args.peak, "matmul_weights": macs, "repeats": args.repeats,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(info))
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
