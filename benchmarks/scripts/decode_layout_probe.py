"""What an "outputs in lanes" weight layout would give one-row (decode) 4-bit matmuls: the
engine's decode loop (`q_matmul`, path 1) against the probe kernel in
`decode_layout_probe.c`, on the same byte count per weight, side by side in one process
(AVX-512 VNNI machines only).

    python benchmarks/scripts/decode_layout_probe.py [threads]

Two cases: hot (one 1024 × 1536 matrix, in cache: the kernels' compute rate) and streaming (12
matrices of 8960 × 1536, 165 MB: beyond the last-level cache, as decode reads weights), each
the median of 7 rounds, reported as GB/s of weights read. Process CPU time with one thread
(robust on a shared machine), wall time with more. The probe's weights are random bytes in its
layout: this measures speed only; the engine's kernels are what compute the model.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve import kernels
from specserve.weights.quant import NativeLinear

PROBE = Path(__file__).with_name("decode_layout_probe.c")
K, SB = 1536, 256


def bytes_of(n: int, k: int) -> float:
    """4-bit weights + int16 block scale + fp16 block minimum + float super-block step."""
    return n * k * (0.5 + 2 / 32 + 2 / 32 + 4 / SB)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    if "avx512_vnni" not in kernels.available_isas():
        sys.exit("this probe needs AVX-512 VNNI")
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    probe = ctypes.CDLL(str(kernels.build(PROBE, flags=kernels.isa_flags("avx512_vnni"))))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    probe.probe_matmul1.argtypes = [p, i64, i64, p, p, p, p, i64, p]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=g)
    print(f"{threads} thread(s), {'CPU' if threads == 1 else 'wall'} time")
    for label, n, count in (("hot", 1024, 1), ("streaming", 8960, 12)):
        engine = [NativeLinear(torch.randn(n, K, generator=g) * 0.02, None, 4, "avx512_vnni")
                  for _ in range(count)]
        ours = [(torch.randint(0, 256, (n * K // 2,), dtype=torch.uint8, generator=g),
                 torch.randint(0, 100, (n * K // 32,), dtype=torch.int16, generator=g),
                 torch.rand(n * K // 32, generator=g).half(), torch.rand(n * K // SB, generator=g))
                for _ in range(count)]
        y = torch.empty(n)
        reps = 200 if label == "hot" else 1
        times = {"engine decode loop": [], "probe": []}
        for _ in range(7):
            start = clock()
            for _ in range(reps):
                for layer in engine:
                    layer(x, 1)
            times["engine decode loop"].append(clock() - start)
            start = clock()
            for _ in range(reps):
                for w, sc, mn, ds in ours:
                    probe.probe_matmul1(x.data_ptr(), K, SB, w.data_ptr(), sc.data_ptr(),
                                        mn.data_ptr(), ds.data_ptr(), n, y.data_ptr())
            times["probe"].append(clock() - start)
        total = bytes_of(n, K) * count * reps
        print(f"{label:9s} " + "  ".join(f"{name}: {total / statistics.median(t) / 1e9:5.1f} GB/s"
                                         for name, t in times.items()))


if __name__ == "__main__":
    main()
