"""T_verify(k) / T_decode: how much a (k + 1)-row pass against a cached prefix costs compared
with a one-row decode step, on this machine, for a loaded model."""

from __future__ import annotations

import statistics
import time

import torch

from specserve.engine.runner import ModelRunner


def verify_cost(runner: ModelRunner, ks: list[int], prefix_len: int = 256, repeats: int = 5
                ) -> dict[int, float]:
    """Median seconds of a pass over k + 1 rows at position `prefix_len`, for each k (k = 0 is
    the decode step). The prefix is prefilled once; each pass rewrites the same positions."""
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    slot = runner.cache.allocate()
    try:
        runner.forward([prefix], [0], [slot], [1])
        times = {}
        for k in [0, *ks]:
            rows = [torch.randint(0, vocab, (k + 1,), generator=g).tolist()]
            runner.forward(rows, [prefix_len], [slot])  # warm-up
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                runner.forward(rows, [prefix_len], [slot])
                samples.append(time.perf_counter() - start)
            times[k] = statistics.median(samples)
        return times
    finally:
        runner.cache.release(slot)


def format_verify_cost(times: dict[int, float]) -> str:
    base = times[0]
    lines = ["| k | rows | T_verify ms | T_verify(k) / T_decode |", "|---|---|---|---|"]
    lines += [f"| {k} | {k + 1} | {t * 1e3:.1f} | {t / base:.2f} |" for k, t in sorted(times.items())]
    return "\n".join(lines)
