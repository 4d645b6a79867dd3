"""A model and its KV cache: runs batched passes over ragged rows of tokens."""

from __future__ import annotations

import statistics
import time

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
        tokens, for each k in `ks` (k = 0 is a decode step). Needs one free slot; the prefix is
        prefilled once and each pass rewrites the same positions."""
        vocab = self.model.cfg.vocab_size
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
        slot = self.cache.allocate()
        try:
            self.forward([prefix], [0], [slot], [1])
            times = {}
            for k in ks:
                rows = [torch.randint(0, vocab, (k + 1,), generator=g).tolist()]
                self.forward(rows, [prefix_len], [slot])  # warm-up
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    self.forward(rows, [prefix_len], [slot])
                    samples.append(time.perf_counter() - start)
                times[k] = statistics.median(samples)
            return times
        finally:
            self.cache.release(slot)
