"""float32 against float16 KV cache on the int4 target, alternated call by call in one process.

    python benchmarks/scripts/kv_cache_dtype.py [rounds] [max_tokens] [--out FILE.json]

The shipped `code_edit` workload (chat template, greedy, EOS ignored, prefix caching off so
every call prefills from an empty cache), target only, 2 threads. Each round runs one call per
cache dtype in turn (after one warm-up call each); reports per dtype the medians of decode
tokens/s (tokens after the first over the time after the first) and TTFT, their ratio, and how
many greedy tokens the float16 cache gives identically to the float32 one (the longest common
prefix and the count of equal positions: a rounded key can legitimately flip a near-tie).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys

import torch

from specserve import kernels
from specserve.bench import workloads
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams

TARGET = "qwen2.5-coder-1.5b"
THREADS = 2
DTYPES = ("float32", "float16")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(rounds: int, max_tokens: int, out_path: str | None) -> None:
    torch.set_num_threads(THREADS)
    target = load_model(TARGET)
    tok = target.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user",
                                               "content": workloads.load("code_edit")}]))
    llms = {d: LLM(target, max_num_seqs=1, enable_prefix_caching=False, kv_cache_dtype=d,
                   kv_cache_memory=256 << 20) for d in DTYPES}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runs: dict[str, list] = {d: [] for d in DTYPES}
    for r in range(rounds + 1):  # round 0: warm-up
        for d in DTYPES:
            out = llms[d].generate(ids, params)[0].outputs[0]
            if r:
                runs[d].append(out)
            print(f"round {r} {d}: decode {out.decode_tokens_per_s:.2f} tok/s, "
                  f"TTFT {out.ttft:.2f} s", file=sys.stderr, flush=True)
    a, b = runs["float32"][0].token_ids, runs["float16"][0].token_ids
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    report = {
        "cpu": cpu_name(), "isa": kernels.isa(), "threads": THREADS, "prompt_tokens": len(ids),
        "max_tokens": max_tokens, "rounds": rounds,
        "kv_dtype": {d: {"cache_dtype": str(llms[d].engine.runner.cache.keys.dtype),
                         "decode_tokens_per_s": statistics.median(
                             o.decode_tokens_per_s for o in runs[d]),
                         "ttft_s": statistics.median(o.ttft for o in runs[d]),
                         "all_decode_tokens_per_s": [o.decode_tokens_per_s for o in runs[d]]}
                     for d in DTYPES},
        "same_tokens_each_round": {d: all(o.token_ids == runs[d][0].token_ids for o in runs[d])
                                   for d in DTYPES},
        "float16_vs_float32_common_prefix": prefix,
        "float16_vs_float32_equal_positions": sum(x == y for x, y in zip(a, b)),
    }
    f32, f16 = (report["kv_dtype"][d]["decode_tokens_per_s"] for d in DTYPES)
    report["decode_ratio_f16_over_f32"] = f16 / f32
    text = json.dumps(report, indent=2)
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    argv = sys.argv[1:]
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    main(int(argv[0]) if argv else 3, int(argv[1]) if len(argv) > 1 else 128, out)
