"""Per-sequence KV cache in fixed slots.

Each sequence owns one slot: a `[max_len]` strip of keys and values in every layer. How much of
the strip is valid is an integer the sequence keeps (`num_cached`); rolling a rejected draft back
is moving that integer back. Stale entries past it are overwritten by the next write, never
copied or cleared.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)  # [layer, slot, kv_head, pos, head_dim]
        self.values = torch.zeros(shape, dtype=dtype)  # [layer, slot, kv_head, pos, head_dim]
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)

    def write(self, layer: int, slots: list[int], starts: list[int], lengths: list[int],
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` ([batch, kv_head, T, head_dim]) at positions `start:start+length` of each slot."""
        for row, (slot, start, n) in enumerate(zip(slots, starts, lengths)):
            assert start + n <= self.max_len, "sequence longer than the KV cache"
            self.keys[layer, slot, :, start:start + n] = k[row, :, :n]
            self.values[layer, slot, :, start:start + n] = v[row, :, :n]

    def read(self, layer: int, slots: list[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions `[0, end)` for `slots`: `[batch, kv_head, end, head_dim]`."""
        if len(slots) == 1:  # a view, no copy
            s = slots[0]
            return self.keys[layer, s:s + 1, :, :end], self.values[layer, s:s + 1, :, :end]
        index = torch.tensor(slots)
        return (self.keys[layer, index, :, :end], self.values[layer, index, :, :end])
