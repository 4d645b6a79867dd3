"""Ours against llama.cpp, interleaved call by call in one process: the comparison that stays
fair on a machine whose memory bandwidth drifts by tens of percent within minutes (a shared
host), which a run of all our calls and then all of the peer's does not.

    python benchmarks/scripts/e2e_vs_llama_cpp.py [rounds] [max_tokens] [--out FILE.json]

Each round runs, on the shipped `code_edit` and `creative` workloads (chat template, greedy,
EOS ignored, every call from an empty cache: prefix caching off, llama.cpp reset), one call of
each configuration in turn: our target only, llama.cpp target only, our n-gram cost-aware,
llama.cpp prompt lookup (4 tokens), our draft-model cost-aware (default pair). Reports per
configuration the medians of TTFT, decode tokens/s (tokens after the first over the time after
the first) and E2E, and per round the paired ratios (ours / llama.cpp's decode rate, their E2E
/ ours), medians over rounds. Needs `llama-cpp-python`; int4 weights (`weights="auto"` on the
Q4_K_M files), 2 threads for both engines.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from specserve import kernels
from specserve.bench import workloads
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
WORKLOADS = ("code_edit", "creative")
THREADS = 2


def ours(llm: LLM, ids: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True))[0].outputs[0]
    e2e = time.perf_counter() - start
    spec = out.spec
    return {"ttft_s": out.ttft, "decode_tokens_per_s": out.decode_tokens_per_s, "e2e_s": e2e,
            "tokens": len(out.token_ids),
            "drafted": spec.drafted if spec is not None else 0,
            "accepted": spec.accepted if spec is not None else 0}


def theirs(llm, ids: list[int], max_tokens: int, ban: dict[int, float]) -> dict:
    llm.reset()  # no prompt reuse between calls
    start = time.perf_counter()
    times = [time.perf_counter() for _ in llm.create_completion(
        ids, max_tokens=max_tokens, temperature=0.0, top_k=1, logit_bias=ban or None,
        stream=True)]
    return {"ttft_s": times[0] - start,
            "decode_tokens_per_s": (len(times) - 1) / max(1e-9, times[-1] - times[0]),
            "e2e_s": times[-1] - start, "tokens": len(times)}


def main(rounds: int, max_tokens: int, out_path: str | None) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    torch.set_num_threads(THREADS)
    target, draft = load_model(TARGET), load_model(DRAFT)
    tok = target.tokenizer
    prompts = {w: tok.encode(tok.apply_chat_template([{"role": "user",
                                                        "content": workloads.load(w)}]))
               for w in WORKLOADS}
    n_ctx = max(len(ids) for ids in prompts.values()) + max_tokens + 64
    ban = {int(t): float("-inf") for t in tok.eos_token_ids}
    engines = {
        "ours target only": ("ours", LLM(target, enable_prefix_caching=False)),
        "llama.cpp target only": ("theirs", Llama(model_path=str(target.path), n_ctx=n_ctx,
                                                  n_threads=THREADS, n_batch=512, verbose=False)),
        "ours ngram cost-aware": ("ours", LLM(target, enable_prefix_caching=False,
                                              speculative_config={"method": "ngram",
                                                                  "num_speculative_tokens": -1})),
        "llama.cpp prompt lookup": ("theirs", Llama(
            model_path=str(target.path), n_ctx=n_ctx, n_threads=THREADS, n_batch=512,
            verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4),
            logits_all=True)),
        "ours draft cost-aware": ("ours", LLM(target, draft=draft, enable_prefix_caching=False,
                                              speculative_config={"method": "draft_model",
                                                                  "model": DRAFT,
                                                                  "num_speculative_tokens": -1})),
    }

    def call(kind, engine, ids, n):
        return ours(engine, ids, n) if kind == "ours" else theirs(engine, ids, n, ban)

    for kind, engine in engines.values():  # warm-up: page the weights in, build the kernels
        call(kind, engine, prompts["creative"], 8)
    records = []
    for r in range(rounds):
        for w, ids in prompts.items():
            for name, (kind, engine) in engines.items():
                rec = {"round": r, "workload": w, "config": name, "prompt_tokens": len(ids),
                       **call(kind, engine, ids, max_tokens)}
                records.append(rec)
                print(json.dumps(rec), flush=True)
    summary = summarize(records)
    flags = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")
             if f in kernels.cpu_flags()]
    print(f"\nCPU flags: {' '.join(flags)}; kernels: {kernels.isa()}; {THREADS} threads; "
          f"{rounds} rounds x {max_tokens} tokens")
    print("| workload | config | TTFT s | decode tok/s | E2E s | paired decode vs llama.cpp "
          "target only | paired E2E speedup vs llama.cpp best |")
    print("|---|---|---|---|---|---|---|")
    for row in summary:
        print(f"| {row['workload']} | {row['config']} | {row['ttft_s']:.2f} | "
              f"{row['decode_tokens_per_s']:.2f} | {row['e2e_s']:.2f} | "
              f"{row['decode_vs_llama_target']:.2f}x | {row['e2e_vs_llama_best']:.2f}x |")
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"cpu_flags": flags, "isa": kernels.isa(), "threads": THREADS,
                       "rounds": rounds, "max_tokens": max_tokens, "records": records,
                       "summary": summary}, f, indent=1)


def summarize(records: list[dict]) -> list[dict]:
    """Medians per (workload, config), and per round: decode rate over llama.cpp target only's,
    and the faster llama.cpp configuration's E2E over this one's."""
    by = {}
    for rec in records:
        by.setdefault((rec["workload"], rec["config"]), {})[rec["round"]] = rec
    rows = []
    for (w, name), per_round in by.items():
        base = by[(w, "llama.cpp target only")]
        best = {r: min(by[(w, c)][r]["e2e_s"] for c in ("llama.cpp target only",
                                                          "llama.cpp prompt lookup"))
                for r in per_round}
        rows.append({
            "workload": w, "config": name,
            **{k: statistics.median(rec[k] for rec in per_round.values())
               for k in ("ttft_s", "decode_tokens_per_s", "e2e_s")},
            "decode_vs_llama_target": statistics.median(
                rec["decode_tokens_per_s"] / base[r]["decode_tokens_per_s"]
                for r, rec in per_round.items()),
            "e2e_vs_llama_best": statistics.median(best[r] / rec["e2e_s"]
                                                   for r, rec in per_round.items())})
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    if out in args:
        args.remove(out)
    main(int(args[0]) if args else 3, int(args[1]) if len(args) > 1 else 256, out)
