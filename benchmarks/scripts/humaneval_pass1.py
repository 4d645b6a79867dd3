"""Target-only greedy pass@1 on HumanEval, one problem at a time, resumable.

Same prompt, code extraction and sandbox as the frontier suite (`specserve/bench/humaneval.py`,
`checkers.check`). Appends one JSON line per problem to --out and skips problems already
there, so an interrupted run continues where it stopped.

E.g. `nice -n 19 python benchmarks/scripts/humaneval_pass1.py --out run.jsonl --minutes 40`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specserve.bench.checkers import check
from specserve.bench.humaneval import chat_ids, load_humaneval
from specserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="the first N problems")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--minutes", type=float, default=None, help="stop starting new problems "
                    "after this many minutes")
    args = ap.parse_args()
    done = set()
    if args.out.exists():
        done = {json.loads(line)["task_id"] for line in args.out.read_text().splitlines()}
    tasks = [t for t in load_humaneval(args.limit) if t.id not in done]
    llm = LLM(args.model, speculative_config=None, max_num_seqs=1, max_model_len=2048)
    start = time.perf_counter()
    for task in tasks:
        if args.minutes is not None and time.perf_counter() - start > 60 * args.minutes:
            break
        ids = chat_ids(llm.tokenizer, task.prompt, task.response_prefix)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop=task.stop)
        out = llm.generate(ids, params)[0].outputs[0]
        verdict = check(task, out.text)
        rec = {"task_id": task.id, "passed": verdict.correct, "reason": verdict.reason,
               "finish_reason": out.finish_reason, "output_tokens": out.num_output_tokens,
               "e2e_s": out.e2e_time, "text": out.text}
        with args.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{task.id}: {'pass' if verdict.correct else 'FAIL'} "
              f"({out.num_output_tokens} tokens, {out.e2e_time:.1f} s) {verdict.reason[:80]}",
              flush=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines()]
    passed = sum(r["passed"] for r in rows)
    print(f"pass@1 {passed}/{len(rows)} = {passed / len(rows):.1%}")


if __name__ == "__main__":
    main()
