"""Two versions of the matmul kernels' source timed in one process, call by call, on the same
weights and activations: the way to judge a kernel change on a shared, noisy machine.

    python benchmarks/scripts/matmul_ab.py OLD.c NEW.c [--isa avx512_vnni] [--n 17920] [--k 1536]
        [--bits 4] [--rows 1 4 5 8 9 32] [--repeats 7] [--copies 8]

e.g. `git show HEAD:specserve/kernels/qmatmul.c > /tmp/old.c` against the working tree's file.
Each repeat times every row count on both builds, the order of the two swapped every repeat;
each figure is the median over repeats of one call's time, and every call's outputs must be
the same bits on both sides (the kernels' contract: a change of speed, never of results).
`--copies` distinct weight matrices are cycled so that the weights stream from memory as a
model's do (8 × 17920 × 1536 at 4 bits: 110 MB), not from the last-level cache.

Why in one process: single runs of the same build drifted by up to 1.35× between minutes here
(Zen 4, 2 cores, shared host), more than most kernel changes are worth; two builds measured
minutes apart once read as a 1.15× gain that an alternated run showed to be 1.00×.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specserve import kernels
from specserve.weights.quant import NativeLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--isa", default=kernels.isa(), choices=kernels.available_isas())
    p.add_argument("--n", type=int, default=17920, help="outputs (default: the 1.5B's gate_up)")
    p.add_argument("--k", type=int, default=1536, help="inputs")
    p.add_argument("--bits", type=int, default=4, choices=(4, 6, 8))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 6, 8, 9, 10, 16, 32])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--copies", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    libs = [kernels._load_qmatmul(args.isa, path) for path in (args.old, args.new)]
    if None in libs:
        raise SystemExit("a source failed to build (see the warning above)")
    layers = [NativeLinear(torch.randn(args.n, args.k) * 0.02, None, args.bits, args.isa)
              for _ in range(args.copies)]
    times: dict[tuple[int, int], list[float]] = {}
    for rep in range(args.repeats):
        for rows in args.rows:
            x = torch.randn(rows, args.k)
            outs = [torch.empty(rows, args.n), torch.empty(rows, args.n)]
            for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
                for layer in layers:
                    layer._lib = libs[side]
                start = time.perf_counter()
                for _ in range(2):
                    for layer in layers:
                        layer.into(x, outs[side])
                times.setdefault((rows, side), []).append(
                    (time.perf_counter() - start) / (2 * args.copies))
            if not torch.equal(outs[0], outs[1]):
                raise SystemExit(f"{rows} rows: the two builds' outputs differ")
    one = [statistics.median(times[(args.rows[0], side)]) for side in (0, 1)]
    print(f"{args.isa}, n={args.n} k={args.k} {args.bits}-bit, medians of {args.repeats}; "
          f"'xN': a call's time over the {args.rows[0]}-row call's")
    print("rows    old ms    new ms  new/old   old xN  new xN  new GMAC/s")
    for rows in args.rows:
        old, new = (statistics.median(times[(rows, side)]) for side in (0, 1))
        print(f"{rows:4d}  {old * 1e3:8.3f}  {new * 1e3:8.3f}  {new / old:7.2f}  "
              f"{old / one[0]:7.2f} {new / one[1]:7.2f}  {rows * args.n * args.k / new / 1e9:9.1f}")


if __name__ == "__main__":
    main()
