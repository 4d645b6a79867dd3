"""Prefill on each path, in one process: `specserve/bench/prefill_paths.py` (its docstring
says what is timed and how).

    python benchmarks/scripts/prefill_paths.py --tokens 512,2048 --repeats 5 --out FILE
"""

from specserve.bench.prefill_paths import main

if __name__ == "__main__":
    main()
