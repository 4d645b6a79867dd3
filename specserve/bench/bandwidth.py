"""How close decoding runs to the memory limit.

A decode step of one sequence reads every weight once (plus one embedding row and its KV
cache), so its rate can never beat read bandwidth / bytes read per token. `specserve bench`
measures this machine's read bandwidth with the threads it runs on and reports each format's
decode rate as a fraction of that ceiling.
"""

from __future__ import annotations

import dataclasses
import time

import torch

BANDWIDTH_BYTES = 1 << 30  # read a 1 GiB buffer: far beyond any last-level cache


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes per second of the fastest of `repeats` full reads (a float32 sum) of an `nbytes`
    buffer, with torch's current thread count: the best the machine delivered, since a
    ceiling under the rate a shared host sometimes gives would put decode above 100% of it."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # [n] touched once, so it is resident
    buf.sum()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return nbytes / min(times)


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor held by `obj` (a tensor, a dataclass of tensors or an object
    whose attributes are), each tensor counted once (a tied head is the embedding; many
    weights may be views of one memory-mapped storage, so views are told apart by where they
    start and how long they are, not by their storage)."""
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.numel() * obj.element_size())
        if key in seen:
            return 0
        seen.add(key)
        return key[1]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_tensor_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values()
                   if isinstance(v, torch.Tensor) or dataclasses.is_dataclass(v))
    return 0


def decode_bytes_per_token(model, context: int = 0, kv_dtype: torch.dtype = torch.float32) -> int:
    """Bytes one decode step of `model` (a `Transformer`) reads: every projection and the
    output head, the norms, one embedding row, and the keys and values of `context` cached
    positions (`kv_dtype` elements)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            total += _tensor_bytes(getattr(layer, name), seen)
        total += _tensor_bytes(layer.attn_norm, seen) + _tensor_bytes(layer.mlp_norm, seen)
    total += _tensor_bytes(model.lm_head, seen) + _tensor_bytes(model.norm, seen)
    embed = model.embed
    if (embed.data_ptr(), embed.numel() * embed.element_size()) not in seen:  # untied: one row
        total += embed.shape[1] * embed.element_size()
    c = model.cfg
    total += 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_dtype.itemsize * context
    return total


def ceiling(model, bandwidth: float, context: int = 0,
            kv_dtype: torch.dtype = torch.float32) -> dict:
    """The memory-bound decode ceiling of `model` on this machine."""
    per_token = decode_bytes_per_token(model, context, kv_dtype)
    return {"read_bandwidth_gbs": bandwidth / 1e9, "bytes_per_token": per_token,
            "context": context, "ceiling_tokens_per_s": bandwidth / per_token}
