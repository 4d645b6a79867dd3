"""Prefill on each path, in one process: time to first token of prompts of given lengths, target
only, with the prompt rows on the int4 kernels (`--prefill-path native`) and on oneDNN
(`onednn`, forced), the two sides alternated call by call (the side that goes first swaps every
round), each call after the prefix cache is emptied. Also: what "auto" chooses here (its
start-up line), and oneDNN's own bf16 rate on large square matmuls, the peak the prefill's
FLOP rate is put against.

    python benchmarks/scripts/prefill_paths.py --tokens 512,2048 --repeats 5 --out FILE

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

import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.bench import workloads

PATHS = ("native", "onednn")


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
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    peak = peak_tflops()
    record = _writer(args.out)
    record({"peak_bf16_tflops": peak, "threads": torch.get_num_threads()})
    options = dict(speculative_config=None, max_model_len=max(lengths) + 64,
                   kv_cache_memory=1 << 30)
    llms = {"native": LLM(args.model, prefill_path="native", **options)}
    target = llms["native"].target
    start = time.perf_counter()  # the start-up's dense copies: the whole model dequantized once
    llms["onednn"] = LLM(target, prefill_path="onednn", **options)
    record({"onednn_startup_s": time.perf_counter() - start})
    if not args.no_auto:
        start = time.perf_counter()
        auto = LLM(target, prefill_path="auto", **options)
        record({"auto": auto.engine.runner.prefill.label(),
                "auto_startup_s": time.perf_counter() - start})
        del auto
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict = {(p, n): [] for p in PATHS for n in lengths}
    for n in lengths:
        ids = prompt_ids(llms["native"], n)
        for llm in llms.values():  # a warm-up call each (first-call costs)
            llm.reset_prefix_cache()
            llm.generate(ids[:64], params)
        for r in range(args.repeats):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                llm = llms[path]
                llm.reset_prefix_cache()
                seconds = _seconds(lambda: llm.generate(ids, params))
                times[(path, n)].append(seconds)
                record({"path": path, "tokens": n, "round": r, "seconds": seconds})
    best_peak = max(peak.values())
    cfg = target.config
    for n in lengths:
        row = {"tokens": n}
        for path in PATHS:
            med = statistics.median(times[(path, n)])
            rate = prompt_flops(cfg, n) / med / 1e12
            row[path] = {"ttft_s": med, "tokens_per_s": n / med, "tflops": rate,
                         "fraction_of_peak": rate / best_peak}
        row["onednn_over_native"] = statistics.median(
            a / b for a, b in zip(times[("native", n)], times[("onednn", n)]))
        record({"summary": row})


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
