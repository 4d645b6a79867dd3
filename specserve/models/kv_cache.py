"""A model's KV cache tensors: per layer, key and value pools of fixed-size blocks.

A pool is `[num_blocks, kv_heads, block_size, head_dim]` per layer, of the cache's dtype:
float32, float16 or bfloat16. Writes round to it (nearest even); attention reads it widened to
float32, so a float16 cache halves the bytes a decode step reads at the cost of keys and values
rounded to 11 significant bits (llama.cpp keeps its cache in float16 by default). Which blocks
hold a sequence's positions is its block table (position p lives in block
`table[p // block_size]` at offset `p % block_size`); who owns which block is decided outside the model (the engine's
block manager). The pools are allocated with `torch.empty`, so the operating system maps a
block's pages only when a sequence first writes to it: resident memory follows the tokens held.

`kv_cache_dtype` (an engine option, as in vLLM) names the dtype: "auto" is float16 where a
model's layers run on the native glue (float32 activations: the quantized formats) and the
activations' dtype elsewhere; "float32", "float16", "bfloat16" force one.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_SIZE = 16
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}


def check_kv_cache_dtype(value: object) -> str:
    """`value` if it names a cache dtype (`KV_CACHE_DTYPES`); ValueError naming the field if not."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")
    return value


def resolve_kv_cache_dtype(kv_cache_dtype: str, native_glue: bool,
                           act_dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for the option `kv_cache_dtype`: "auto" gives float16 for a model on the
    native glue (`native_glue`) and its activations' dtype `act_dtype` otherwise."""
    named = KV_CACHE_DTYPES[check_kv_cache_dtype(kv_cache_dtype)]
    if named is not None:
        return named
    return torch.float16 if native_glue else act_dtype


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"a KV cache holds float32, float16 or bfloat16, got {dtype}")
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = torch.empty(shape, dtype=dtype)  # [layer, block, kv_head, offset, head_dim]
        self.values = torch.empty(shape, dtype=dtype)  # [layer, block, kv_head, offset, head_dim]
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one cached position takes in every layer (keys and values)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in this cache (keys and values, every layer)."""
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store `k`, `v` (`[rows, kv_head, head_dim]`) at flat positions `slot_mapping`
        (`[rows]`, block * block_size + offset), rounded to the cache's dtype (nearest even, as
        the native `rope_store_attend` stores them)."""
        blocks = torch.div(slot_mapping, self.block_size, rounding_mode="floor")  # [rows]
        offsets = slot_mapping - blocks * self.block_size  # [rows]
        self.keys[layer][blocks, :, offsets] = k.to(self.dtype)  # [rows, kv_head, head_dim]
        self.values[layer][blocks, :, offsets] = v.to(self.dtype)
