"""Ragged causal attention over a paged KV cache: every query row of a pass in one call per layer.

A row is one token of one sequence (a prefill chunk's token, a decode step, a verify position);
it attends to positions 0..row_pos of its own sequence, whose keys and values sit in blocks of
the pools (`block_tables[s, p // block_size]`, offset `p % block_size`). The native kernel
(`specserve/kernels/attention.c`) computes each (row, KV head) on its own in a fixed order, so a
row's output is bit-for-bit the same whatever else is in the pass: alone, in a batch, permuted,
on 1 or 2 threads, with any block size. `ragged_attention_reference` is the PyTorch oracle: one
`scaled_dot_product_attention` call per row, the way a single decode step attends.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from specserve import kernels


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q: expected float32 [rows, heads, hd], got {q.dtype} {list(q.shape)}")
    if k_pool.dim() != 4 or k_pool.dtype not in kernels.KV_KINDS \
            or v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError("k_pool, v_pool: expected float32, float16 or bfloat16 [num_blocks, "
                         "kv_heads, block_size, hd] of one shape and dtype, got "
                         f"{k_pool.dtype} {list(k_pool.shape)} and {v_pool.dtype} "
                         f"{list(v_pool.shape)}")
    rows, heads, hd = q.shape
    kv_heads = k_pool.shape[1]
    if k_pool.shape[3] != hd or heads % kv_heads:
        raise ValueError(f"k_pool: {kv_heads} KV heads of dim {k_pool.shape[3]} do not serve "
                         f"{heads} query heads of dim {hd}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables: expected [num_seqs, max_blocks], got "
                         f"{list(block_tables.shape)}")
    for name, t in (("row_seq", row_seq), ("row_pos", row_pos)):
        if t.shape != (rows,):
            raise ValueError(f"{name}: expected [{rows}], got {list(t.shape)}")
    for name, t in (("block_tables", block_tables), ("row_seq", row_seq), ("row_pos", row_pos)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected integers, got {t.dtype}")


def _check_indices(k_pool: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                   row_pos: torch.Tensor) -> None:
    """What the native kernel checks itself: every index a row reads is in range."""
    num_seqs, max_blocks = block_tables.shape
    num_blocks, block_size = k_pool.shape[0], k_pool.shape[2]
    bad = ((row_seq < 0) | (row_seq >= num_seqs)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"row_seq[{bad[0]}] = {int(row_seq[bad[0]])}: not one of the "
                         f"{num_seqs} sequences")
    bad = ((row_pos < 0) | (row_pos >= max_blocks * block_size)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"row_pos[{bad[0]}] = {int(row_pos[bad[0]])}: outside the block "
                         f"table's {max_blocks * block_size} positions")
    ids = block_tables[row_seq.long()]  # [rows, max_blocks]
    used = torch.arange(max_blocks)[None, :] <= (row_pos.long() // block_size)[:, None]
    bad = (used & ((ids < 0) | (ids >= num_blocks))).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"block_tables[{int(row_seq[bad[0]])}]: a block id outside "
                         f"0..{num_blocks - 1}")


def ragged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                               block_tables: torch.Tensor, row_seq: torch.Tensor,
                               row_pos: torch.Tensor, scale: float | None = None,
                               window: int | None = None) -> torch.Tensor:
    """Per row, one `scaled_dot_product_attention` call on its sequence's keys/values 0..row_pos
    (gathered from the blocks once per sequence, read in place per row), the query heads that
    share a KV head folded into its rows (head h reads KV head h // (heads / kv_heads)): the way
    a one-token decode step attends. With a `window`, only the last `window` positions up to
    row_pos (row_pos − window + 1 .. row_pos). Shapes as `ragged_attention`."""
    _check(q, k_pool, v_pool, block_tables, row_seq, row_pos)
    _check_indices(k_pool, block_tables, row_seq, row_pos)
    rows, heads, hd = q.shape
    kv_heads, block_size = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty_like(q)  # [rows, heads, hd]
    for s in row_seq.unique().tolist():
        rows_of = (row_seq == s).nonzero().flatten()  # [T]
        end = int(row_pos[rows_of].max()) + 1
        ids = block_tables[s, :(end - 1) // block_size + 1].long()
        # narrow pools widened to float32 (exact), as the native kernel reads them
        keys = k_pool[ids].float().transpose(0, 1).reshape(1, kv_heads, -1, hd)  # [1, kv, n, hd]
        values = v_pool[ids].float().transpose(0, 1).reshape(1, kv_heads, -1, hd)
        for r, pos in zip(rows_of.tolist(), row_pos[rows_of].tolist()):
            lo = 0 if window is None else max(0, pos + 1 - window)
            grouped = q[r].reshape(1, kv_heads, heads // kv_heads, hd)  # [1, kv, group, hd]
            attn = F.scaled_dot_product_attention(grouped, keys[:, :, lo:pos + 1],
                                                  values[:, :, lo:pos + 1], scale=scale)
            out[r] = attn.reshape(heads, hd)
    return out


def ragged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor,
                     scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of each query row on its own sequence in a paged KV cache.

    q `[rows, heads, hd]` float32; k_pool, v_pool `[num_blocks, kv_heads, block_size, hd]`
    float32, float16 or bfloat16 (one layer's pools, read widened to float32); block_tables
    `[num_seqs, max_blocks]` (block ids of each sequence, in order); row_seq `[rows]` (each
    row's sequence); row_pos `[rows]` (each row's position: it attends to 0..row_pos, its own
    key/value already written). Query head h reads KV head h // (heads / kv_heads). Returns `[rows, heads, hd]` float32; scale defaults to
    1/sqrt(hd). A `window` (sliding-window layers) limits each row to its last `window`
    positions. Native (batch-invariant) where the kernel runs and hd is a multiple of 8, the
    reference otherwise and for a window that some row reaches past (the kernel has none); bad
    shapes or indices raise ValueError.
    """
    _check(q, k_pool, v_pool, block_tables, row_seq, row_pos)
    rows, heads, hd = q.shape
    lib = kernels.attention()
    windowed = window is not None and rows > 0 and int(row_pos.max()) >= window
    if lib is None or hd % 8 or windowed:
        return ragged_attention_reference(q, k_pool, v_pool, block_tables, row_seq, row_pos,
                                          scale, window)
    q = q.contiguous()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    tables, seqs, pos = (t if t.dtype == torch.int32 and t.is_contiguous()
                         else t.to(torch.int32).contiguous()
                         for t in (block_tables, row_seq, row_pos))
    out = torch.empty_like(q)  # [rows, heads, hd]
    num_blocks, kv_heads, block_size, _ = k_pool.shape
    rc = lib.ragged_attention(
        q.data_ptr(), rows, heads, kv_heads, hd, k_pool.data_ptr(), v_pool.data_ptr(),
        kernels.KV_KINDS[k_pool.dtype], num_blocks, block_size, tables.data_ptr(),
        tables.shape[0], tables.shape[1], seqs.data_ptr(), pos.data_ptr(),
        ctypes.c_float(1 / math.sqrt(hd) if scale is None else scale), out.data_ptr())
    if rc == -3:
        _check_indices(k_pool, block_tables, row_seq, row_pos)  # names the bad index
    if rc != 0:
        raise RuntimeError(f"native ragged attention failed (code {rc})")
    return out
