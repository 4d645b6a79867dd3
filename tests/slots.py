"""A fixed-slot view of a model's paged KV cache, for tests that score a few sequences: slot s
owns the blocks [s * per_slot, (s + 1) * per_slot), so a row batch names slots instead of
block tables. E.g. `cache = new_cache(model, 2, 64)`, then
`model.forward(cache.batch([ids], [0], [1]), cache.pool)` feeds `ids` at positions 0.. of
slot 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from specserve.models.transformer import ATTN_DTYPE, ForwardBatch

@dataclass(frozen=True)
class SlotCache:
    pool: KVCache
    per_slot: int  # blocks per slot

    def table(self, slot: int) -> list[int]:
        return list(range(slot * self.per_slot, (slot + 1) * self.per_slot))

    def batch(self, rows: list[list[int]], starts: list[int], slots: list[int]) -> ForwardBatch:
        """`rows[i]` at positions `starts[i]...` of slot `slots[i]`."""
        return ForwardBatch.paged(rows, starts, [self.table(s) for s in slots])

def new_cache(model, num_slots: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE,
              dtype: torch.dtype = ATTN_DTYPE) -> SlotCache:
    """`num_slots` strips of `max_len` positions in a pool of `model.new_pool`."""
    per_slot = -(-max_len // block_size)
    return SlotCache(model.new_pool(num_slots * per_slot, block_size, dtype=dtype), per_slot)
