"""A model and its KV cache: runs batched passes over ragged rows of tokens."""

from __future__ import annotations

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
