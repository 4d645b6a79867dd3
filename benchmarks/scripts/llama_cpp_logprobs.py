"""llama.cpp's log-probabilities for given token sequences (the fidelity report's llama.cpp path,
`specserve/bench/fidelity.py`).

Run by a Python that has `llama_cpp` (llama-cpp-python, built from its sdist so that llama.cpp
is compiled for this CPU), not necessarily specserve's: it needs numpy and llama_cpp only.
Each sequence's prompt is evaluated in one batch, then its continuation one token at a time,
as a decode; the log-softmax of llama.cpp's logits at each continuation position (those of
the last evaluated token: `llama_get_logits_ith(ctx, -1)`; `Llama.scores` holds only what
`logits_all` asks it to keep) is written
(float32, `rows{i}` in an .npz).

    python llama_cpp_logprobs.py --model FILE.gguf --sequences seqs.json --rows-out rows.npz
"""

from __future__ import annotations

import argparse
import json

import llama_cpp
import numpy as np
from llama_cpp import Llama


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


def rows_for(llm: Llama, prompt: list[int], continuation: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(prompt)
    rows = []
    for i, token in enumerate(continuation):
        last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # the last evaluated token's
        rows.append(log_softmax(np.ctypeslib.as_array(last, shape=(llm.n_vocab(),))))
        if i + 1 < len(continuation):
            llm.eval([token])
    return np.stack(rows)  # [n, vocab]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--sequences", required=True)
    p.add_argument("--rows-out", required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    seqs = json.loads(open(args.sequences).read())
    n_ctx = max(len(s["prompt"]) + len(s["continuation"]) for s in seqs) + 16
    llm = Llama(args.model, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, logits_all=False, verbose=False)
    np.savez(args.rows_out, **{f"rows{i}": rows_for(llm, s["prompt"], s["continuation"])
                               for i, s in enumerate(seqs)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
