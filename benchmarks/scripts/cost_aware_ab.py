"""Target only against cost-aware draft-model speculation (lossless), interleaved call by call
on the shipped creative workload at T = 0.7 (the seed table's setting): decode rates, TTFT, how
many tokens were drafted and whether the two texts agree (same seed).

    python benchmarks/scripts/cost_aware_ab.py [max_tokens] [prof]

`prof` adds a cProfile of one call of each.
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from specserve.bench import workloads
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
torch.set_num_threads(2)
t, d = load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")
tok = t.tokenizer
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": workloads.load("creative")}]))
a = LLM(t, enable_prefix_caching=False)
b = LLM(t, draft=d, enable_prefix_caching=False, speculative_config={"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": -1})
n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
def run(llm, seed):
    o = llm.generate(ids, SamplingParams(temperature=0.7, seed=seed, max_tokens=n, ignore_eos=True))[0].outputs[0]
    return o
run(a, 0); run(b, 0)
for r in range(3):
    x = run(a, r); y = run(b, r)
    print(r, "target %.2f tok/s ttft %.2f | cost-aware %.2f tok/s ttft %.2f drafted %s same %s" % (x.decode_tokens_per_s, x.ttft, y.decode_tokens_per_s, y.ttft, y.spec.drafted if y.spec else None, x.token_ids == y.token_ids), flush=True)
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable(); run(b, 9); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    pr = cProfile.Profile(); pr.enable(); run(a, 9); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
