"""A model and its KV cache: runs batched passes over ragged rows of tokens."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from functools import partial
from typing import Callable, Hashable

import torch

from specserve.models.transformer import ForwardBatch, Transformer


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int, max_len: int) -> None:
        self.model = model
        self.cache = model.new_cache(num_slots, max_len)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def forward(self, rows: list[list[int]], starts: list[int], slots: list[int],
                last_n: list[int] | None = None) -> list[torch.Tensor]:
        """Feed `rows[i]` at cache positions `starts[i]...` of `slots[i]`; returns float32 logits
        `[last_n[i] or len(rows[i]), vocab]` per row."""
        with torch.inference_mode():
            return self.model.forward(ForwardBatch.from_lists(rows, starts, slots), self.cache,
                                      last_n)

    def time_passes(self, ks: list[int], prefix_len: int = 256, repeats: int = 5) -> dict[int, float]:
        """Median seconds of a pass over k + 1 rows after a cached prefix of `prefix_len`
        tokens, for each k in `ks` (k = 0 is a decode step). The ks are timed in turn, round
        after round, so a machine that drifts meanwhile skews them alike."""
        with self.pass_timer(prefix_len) as time_pass:
            return median_round_robin({k: partial(time_pass, k) for k in ks}, repeats)

    @contextmanager
    def pass_timer(self, prefix_len: int):
        """A function k → seconds of one pass over k + 1 random rows after a cached random
        prefix of `prefix_len` tokens (each pass rewrites the same positions; the first pass
        of each k is an untimed warm-up). Holds one free slot while open."""
        vocab = self.model.cfg.vocab_size
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
        slot = self.cache.allocate()
        rows: dict[int, list[list[int]]] = {}

        def time_pass(k: int) -> float:
            if k not in rows:
                rows[k] = [torch.randint(0, vocab, (k + 1,), generator=g).tolist()]
                self.forward(rows[k], [prefix_len], [slot])  # warm-up
            start = time.perf_counter()
            self.forward(rows[k], [prefix_len], [slot])
            return time.perf_counter() - start

        try:
            self.forward([prefix], [0], [slot], [1])
            yield time_pass
        finally:
            self.cache.release(slot)


def median_round_robin(timers: dict[Hashable, Callable[[], float]], repeats: int
                       ) -> dict[Hashable, float]:
    """Median of `repeats` calls of each timer (a function returning seconds), called in turn
    round after round, so a machine that drifts meanwhile skews them alike."""
    samples: dict[Hashable, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for key, timer in timers.items():
            samples[key].append(timer())
    return {key: statistics.median(v) for key, v in samples.items()}
