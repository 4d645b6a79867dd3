"""Prefill rate and decode step time of an int4 model on each instruction set's matmul kernels,
side by side in one process: every variant runs the same passes in turn, round after round
(medians of `repeats`), on the same weights, 2 threads.

    python benchmarks/scripts/prefill_kernels.py qwen2.5-coder-1.5b [repeats]

Prints the CPU's vector flags, then per variant: prefill tokens/s of a 512- and a 900-token
prompt, and the decode step time after the 900-token prompt. (Until the 6-bit width came, it
also ran the kernel of commit 30b2545, rows four at a time; that kernel cannot read 6-bit
weights, and its figures stay in benchmarks/results.)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specserve import kernels
from specserve.engine.runner import ModelRunner
from specserve.weights.loader import load_model
from specserve.weights.quant import NativeLinear

PROMPTS = (512, 900)


def native_linears(model) -> list[NativeLinear]:
    lins = [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    return [lin for lin in [*lins, model.lm_head] if isinstance(lin, NativeLinear)]


def main(name: str, repeats: int = 3) -> None:
    torch.set_num_threads(2)
    flags = sorted(f for f in kernels.cpu_flags() if f.startswith(("avx", "fma", "f16c")))
    print(f"CPU flags: {' '.join(flags)}; kernels.isa() = {kernels.isa()}", flush=True)
    model = load_model(name, "bfloat16", weights="int4").model
    lins = native_linears(model)
    libs = {f"now ({isa})": kernels.qmatmul(isa) for isa in kernels.available_isas()}
    runner = ModelRunner(model, num_blocks=max(PROMPTS) // 16 + 8, block_size=16)
    blocks = runner.block_manager()
    table = blocks.new_table()
    assert blocks.reserve(table, max(PROMPTS) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (max(PROMPTS),), generator=g).tolist()

    def use(lib) -> None:
        for lin in lins:
            lin._lib = lib

    def prefill(lib, n: int) -> float:
        use(lib)
        start = time.perf_counter()
        runner.forward([prompt[:n]], [0], [table], [1])
        return time.perf_counter() - start

    def decode(lib) -> float:
        use(lib)
        runner.forward([prompt], [0], [table], [1])  # the context, untimed
        times = []
        for i in range(8):
            start = time.perf_counter()
            runner.forward([[prompt[i]]], [max(PROMPTS)], [table])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    samples: dict[tuple[str, str], list[float]] = {}
    for label, lib in libs.items():  # warm-up: page the weights in, build every library
        prefill(lib, 64)
    for _ in range(repeats):
        for label, lib in libs.items():
            for n in PROMPTS:
                samples.setdefault((label, f"prefill {n}"), []).append(prefill(lib, n))
            samples.setdefault((label, "decode"), []).append(decode(lib))
    logits = {}
    for label, lib in libs.items():  # today's builds give the same bits, as promised
        use(lib)
        logits[label] = runner.forward([prompt[:300]], [0], [table], [1])[0]
    now = [v for label, v in logits.items() if label.startswith("now")]
    same = all(torch.equal(v, now[0]) for v in now)
    print(f"{name}, int4, 2 threads, medians of {repeats}; last logits identical on every "
          f"instruction set today: {same}")
    for label in libs:
        cells = [f"prefill {n}: {n / statistics.median(samples[(label, f'prefill {n}')]):.1f} tok/s"
                 for n in PROMPTS]
        cells.append(f"decode step: {statistics.median(samples[(label, 'decode')]) * 1000:.1f} ms")
        print(f"  {label:22s} " + ", ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
