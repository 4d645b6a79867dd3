"""Time to first token of the shipped code_edit prompt (~900 tokens) and a 64-token greedy
decode, target only, in this checkout: one JSON line. Each call's prompt gets a distinct prefix,
so no prefix cache serves it; the first call warms up (the medians in a report skip it).

    python benchmarks/scripts/prefill_ttft.py CALLS TAG

To compare two checkouts (a kernel change), run this from each in turn, alternating, e.g.
`PYTHONPATH=<other checkout> python benchmarks/scripts/prefill_ttft.py 3 old1`, then the same
from this one, several rounds: the host drifts by more than a kernel change is worth between
minutes, and a side by side alternation cancels it.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench import workloads


def main(calls: int, tag: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("specserve").setLevel(logging.INFO)  # the load and prefill-path lines
    llm = LLM("qwen2.5-coder-1.5b", speculative_config=None)
    text = workloads.load("code_edit")
    out: dict[str, list[float]] = {"ttft": [], "decode": []}
    for i in range(calls):
        start = time.perf_counter()
        llm.chat([{"role": "user", "content": f"[{tag}-{i}] {text}"}],
                 SamplingParams(temperature=0.0, max_tokens=1))
        out["ttft"].append(time.perf_counter() - start)
        start = time.perf_counter()
        llm.chat([{"role": "user", "content": f"[{tag}-{i}] Say hi."}],
                 SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        out["decode"].append(time.perf_counter() - start)
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
