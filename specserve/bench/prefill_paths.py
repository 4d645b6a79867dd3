"""Prefill on each path, in one process: time to first token of prompts of given lengths, target
only, with the prompt rows on the int4 kernels (`--prefill-path native`), on oneDNN (`onednn`,
forced), and (`--paths`) with only attention (`attention`) or only the four projections
(`projections`) on oneDNN, the sides alternated call by call (the order rotates every round),
each call after the prefix cache is emptied. Also: what "auto" chooses here (its start-up line,
with `max_model_len` the longest prompt), oneDNN's own bf16 rate on large square matmuls, the
peak the prefill's FLOP rate is put against, and (`--attention-contexts`) one layer's attention
of a chunk of prompt rows ending at each context, on each path, as "auto" times it.

    python -m specserve.bench.prefill_paths --tokens 512,2048 --repeats 5 --out FILE
    python -m specserve.bench.prefill_paths --tokens 8500,12000 --repeats 2 \
        --paths native,onednn,attention --attention-contexts 1024,4096,8192,12288,16384

Prompts: the shipped code_edit prompt's tokens, repeated to the length asked. FLOPs of a
prompt of n tokens: 2 per weight of every layer's projections per token, and 4·heads·hd per
(query, key) pair of the causal attention (QKᵀ and PV); the head's one row is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from specserve.bench import workloads
from specserve.engine.prefill_choice import attention_runs
from specserve.models.prefill import NATIVE, ONEDNN, PROJECTIONS, PrefillChoice
from specserve.speculative.calibration import settled_medians

CHOICES = {"native": NATIVE, "onednn": ONEDNN, "attention": PrefillChoice((), 0),
           "projections": PrefillChoice(PROJECTIONS)}


def peak_tflops(repeats: int = 5) -> dict:
    """oneDNN's bf16 rate (PyTorch's matmul) on large square matmuls: the best per shape."""
    out = {}
    for n in (2048, 4096, 6144):
        a = torch.randn(n, n).bfloat16()
        b = torch.randn(n, n).bfloat16()
        F.linear(a, b)
        best = min(_seconds(lambda: F.linear(a, b)) for _ in range(repeats))
        out[n] = 2 * n ** 3 / best / 1e12
    return out


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prompt_flops(cfg, n: int) -> float:
    """FLOPs of prefilling n tokens (see the module doc)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = (cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
               + cfg.hidden_size * 2 * cfg.intermediate_size
               + cfg.intermediate_size * cfg.hidden_size)
    pairs = n * (n + 1) // 2
    return cfg.num_layers * (2 * weights * n + 4 * cfg.num_heads * cfg.head_dim * pairs)


def prompt_ids(llm: LLM, n: int) -> list[int]:
    ids = llm.tokenizer.encode(workloads.load("code_edit"))
    return (ids * (n // len(ids) + 1))[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", default="512,2048", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side and length")
    parser.add_argument("--out", help="append one JSON line per call and the summary here")
    parser.add_argument("--no-auto", action="store_true", help="skip the auto choice's line")
    parser.add_argument("--paths", default="native,onednn",
                        help=f"comma-separated sides among {', '.join(CHOICES)} (first: baseline)")
    parser.add_argument("--attention-contexts", default="",
                        help="comma-separated contexts to time one layer's attention at")
    parser.add_argument("--attention-rows", type=int, default=256,
                        help="prompt rows of the attention timed (the engine's chunk)")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in CHOICES]
    if unknown or len(paths) < 2:
        parser.error(f"--paths: two or more of {list(CHOICES)}, got {args.paths!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    peak = peak_tflops()
    record = _writer(args.out)
    record({"peak_bf16_tflops": peak, "threads": torch.get_num_threads()})
    options = dict(speculative_config=None, max_model_len=max(lengths) + 64,
                   kv_cache_memory=1 << 30)
    first = LLM(args.model, prefill_path="native", **options)
    target = first.target
    llms = {}
    for path in paths:
        start = time.perf_counter()  # the start-up's dense copies: the model dequantized once
        llms[path] = first if path == paths[0] else LLM(target, prefill_path="native",
                                                         **options)
        llms[path].engine.runner.use_prefill(CHOICES[path])
        record({"path": path, "choice": CHOICES[path].label(),
                "startup_s": time.perf_counter() - start,
                "dense_bytes": llms[path].engine.runner.prefill_bytes})
    if args.attention_contexts:
        record({"attention_ms": attention_ms(
            target, [int(c) for c in args.attention_contexts.split(",")], args.attention_rows)})
    if not args.no_auto:
        start = time.perf_counter()
        auto = LLM(target, prefill_path="auto", **options)
        record({"auto": auto.engine.runner.prefill.label(),
                "auto_startup_s": time.perf_counter() - start})
        del auto
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict = {(p, n): [] for p in paths for n in lengths}
    for n in lengths:
        ids = prompt_ids(llms[paths[0]], n)
        for llm in llms.values():  # a warm-up call each (first-call costs)
            llm.reset_prefix_cache()
            llm.generate(ids[:64], params)
        for r in range(args.repeats):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                llm = llms[path]
                llm.reset_prefix_cache()
                seconds = _seconds(lambda: llm.generate(ids, params))
                times[(path, n)].append(seconds)
                record({"path": path, "tokens": n, "round": r, "seconds": seconds})
    best_peak = max(peak.values())
    cfg = target.config
    for n in lengths:
        row = {"tokens": n}
        for path in paths:
            med = statistics.median(times[(path, n)])
            rate = prompt_flops(cfg, n) / med / 1e12
            row[path] = {"ttft_s": med, "tokens_per_s": n / med, "tflops": rate,
                         "fraction_of_peak": rate / best_peak}
            if path != paths[0]:  # the median of the round-by-round ratios
                row[f"{path}_over_{paths[0]}"] = statistics.median(
                    a / b for a, b in zip(times[(paths[0], n)], times[(path, n)]))
        record({"summary": row})


def attention_ms(target, contexts: list[int], rows: int) -> list[dict]:
    """One layer's attention of `rows` prompt rows ending at each context, native and
    `prefill_attention`: medians of 3 settled calls each (ms), as "auto" times them."""
    g = torch.Generator().manual_seed(0)
    kv_dtype = target.model.kv_cache_dtype()
    out = []
    for context in contexts:
        native, onednn = attention_runs(target.model.cfg, min(rows, context), context,
                                        kv_dtype, g)
        timers = {"native": partial(_seconds, native), "onednn": partial(_seconds, onednn)}
        for run in timers.values():
            run()
        medians, disturbed = settled_medians(timers, 3, 60.0)
        out.append({"context": context, "rows": min(rows, context), "disturbed": disturbed,
                    **{k: v * 1e3 for k, v in medians.items()}})
    return out


def _writer(path: str | None):
    def record(obj: dict) -> None:
        line = json.dumps(obj)
        print(line, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return record


if __name__ == "__main__":
    main()
