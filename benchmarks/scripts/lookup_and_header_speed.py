"""Two speeds that unit tests used to assert and belong here instead: the prompt-lookup
search (`find_ngram_draft`) on 4k-token contexts, and parsing the large-vocabulary GGUF header
of the default target with our reader (`GGUFFile`). Prints the median of `--repeats` timings
of each; nothing is asserted.

    python benchmarks/scripts/lookup_and_header_speed.py [--repeats 51]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specserve.hub.registry import DEFAULT_TARGET, resolve_model
from specserve.speculative.ngram import find_ngram_draft
from specserve.weights.gguf_file import GGUFFile


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=51)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    contexts = {"random 32k vocab": rng.integers(0, 32000, 4096),
                "random 20 tokens": rng.integers(0, 20, 4096), "all zeros": np.zeros(4096, np.int64)}
    for name, tokens in contexts.items():
        t = median_seconds(lambda: find_ngram_draft(tokens, 8, 4, 1), args.repeats)
        print(f"find_ngram_draft, 4096 tokens ({name}): {t * 1e6:.1f} µs")
    path = resolve_model(DEFAULT_TARGET)
    t = median_seconds(lambda: GGUFFile(path).metadata, max(1, args.repeats // 10))
    print(f"GGUFFile header of {path.name}: {t:.3f} s")


if __name__ == "__main__":
    main()
