"""A model's KV cache tensors: per layer, key and value pools of fixed-size blocks.

A pool is `[num_blocks, kv_heads, block_size, head_dim]` float32 per layer. Which blocks hold a
sequence's positions is its block table (position p lives in block `table[p // block_size]`
at offset `p % block_size`); who owns which block is decided outside the model (the engine's
block manager). The pools are allocated with `torch.empty`, so the operating system maps a
block's pages only when a sequence first writes to it: resident memory follows the tokens held.

`new_cache(num_slots, max_len)` on a model keeps the simple one-strip-per-sequence view for
callers that score a few sequences (perplexity, tests): slot s owns a fixed run of blocks.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_SIZE = 16


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype, num_slots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = torch.empty(shape, dtype=dtype)  # [layer, block, kv_head, offset, head_dim]
        self.values = torch.empty(shape, dtype=dtype)  # [layer, block, kv_head, offset, head_dim]
        self.num_blocks, self.block_size = num_blocks, block_size
        per_slot = num_blocks // num_slots if num_slots else 0
        # slot s owns blocks [s * per_slot, (s + 1) * per_slot) (the fixed-strip view)
        self._slot_tables = torch.arange(num_slots * per_slot, dtype=torch.int32).view(
            num_slots, per_slot)  # [num_slots, per_slot]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one cached position takes in every layer (keys and values)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def slot_tables(self, slots: list[int]) -> torch.Tensor:
        """Block tables of fixed slots: `[len(slots), blocks per slot]` int32."""
        return self._slot_tables[torch.tensor(slots, dtype=torch.long)]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store `k`, `v` (`[rows, kv_head, head_dim]`) at flat positions `slot_mapping`
        (`[rows]`, block * block_size + offset)."""
        blocks = torch.div(slot_mapping, self.block_size, rounding_mode="floor")  # [rows]
        offsets = slot_mapping - blocks * self.block_size  # [rows]
        self.keys[layer][blocks, :, offsets] = k  # [rows, kv_head, head_dim] at each
        self.values[layer][blocks, :, offsets] = v
