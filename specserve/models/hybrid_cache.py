"""The caches of a hybrid decoder: a paged KV pool per attention layer that computes keys and
values (each of its own head count and size), and the recurrent states of the linear layers.

Blocks are addressed as in `kv_cache.KVCache` (one block id means the same positions in every
pool), so the engine's block manager serves a hybrid model unchanged. The recurrent states are
per sequence (`recurrent_state.RecurrentStates`), keyed by the sequence's block table;
`release` drops them when the table is freed.
"""

from __future__ import annotations

import torch

from specserve.models.kv_cache import KVCache
from specserve.models.recurrent_state import RecurrentStates


class HybridCache:
    def __init__(self, geometry: list[tuple[int, int] | None], num_blocks: int,
                 block_size: int, dtype: torch.dtype, states: RecurrentStates | None) -> None:
        """`geometry[i]`: (KV heads, head_dim) of layer i's pool, None where the layer has none
        (linear layers, layers reading another layer's pool)."""
        self.pools = [None if g is None else KVCache(1, num_blocks, g[0], block_size, g[1], dtype)
                      for g in geometry]
        self.states = states
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype

    @staticmethod
    def bytes_per_token(geometry: list[tuple[int, int] | None], dtype: torch.dtype) -> int:
        """Bytes one cached position takes in every pool (keys and values)."""
        return sum(KVCache.bytes_per_token(1, g[0], g[1], dtype) for g in geometry if g)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in every pool."""
        return sum(p.block_bytes for p in self.pools if p is not None)

    def release(self, key: object) -> None:
        """The sequence `key` left: forget its recurrent states."""
        if self.states is not None:
            self.states.release(key)
