"""A native pass whose prompt rows take the prefill path (`models/prefill.py`): the layers one
by one from Python, the glue (norms, rotary embedding, cache writes, SwiGLU) native for every
row, each projection split by rows (prompt rows on oneDNN where the choice says so, the others
on the int4 kernel) and attention split likewise (prompt rows from `attention_from` on through
`prefill_attention`, the others through `rope_store_attend`). A row off the prefill path gets
the bits the fused pass gives it: every native kernel's row is the same alone or in a batch.

Within a layer, the keys and values of every row are stored before any row on the prefill
path attends (a prompt row may read the keys of an earlier prompt row of its chunk that is
not on it), and those of the prompt rows before the other rows attend (a recomputed output
row reads its prompt's).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from specserve.kernels.decoder import KVIndex
from specserve.models.kv_cache import KVCache
from specserve.models.prefill import PrefillPath, attention_masks, prefill_attention


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive rows of one sequence that attend on the prefill path."""

    rows: slice  # into the attending rows (`RowSplit.attend`)
    seq: int
    start: int  # the position of its first row
    masks: list  # `attention_masks` of its rows


@dataclass(frozen=True, slots=True)
class RowSplit:
    """A pass's rows by path: `prompt` (prompt rows, ascending) and `other` (the rest; None
    when there are none) for the projections; `attend` (prompt rows at or past
    `attention_from`) and `glue` (the rest, None when none) for attention."""

    prompt: torch.Tensor  # [p] long
    other: torch.Tensor | None  # [rows - p] long
    attend: torch.Tensor  # [a] long
    glue: torch.Tensor | None  # [rows - a] long
    segments: list[Segment]

    @staticmethod
    def of(batch, attention_from: int | None, group: int) -> "RowSplit":
        rows = batch.tokens.shape[0]
        prompt = batch.prefill_rows()
        attend = prompt if attention_from is not None else prompt[:0]
        if attention_from is not None:
            attend = prompt[batch.positions[prompt] >= attention_from]
        segments = []
        seqs, pos = batch.row_seq[attend].tolist(), batch.positions[attend].tolist()
        first = 0
        for i in range(1, len(seqs) + 1):
            if i == len(seqs) or seqs[i] != seqs[first] or pos[i] != pos[i - 1] + 1:
                segments.append(Segment(slice(first, i), seqs[first], pos[first],
                                        attention_masks(pos[first], i - first, group)))
                first = i
        return RowSplit(prompt, _others(prompt, rows), attend, _others(attend, rows), segments)


def _others(rows: torch.Tensor, total: int) -> torch.Tensor | None:
    keep = torch.ones(total, dtype=torch.bool)
    keep[rows] = False
    return keep.nonzero().flatten() if bool(keep.any()) else None


def prefill_layers(model, path: PrefillPath, lib, x: torch.Tensor, batch, bufs,
                   cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, step: int,
                   index: KVIndex, scale: float) -> None:
    """Every layer of `model` over the residual stream `x` `[rows, hidden]` (in place), prompt
    rows on `path`; the other arguments as `Transformer._layer_calls` takes them."""
    c = model.cfg
    split = RowSplit.of(batch, path.choice.attention_from, c.num_heads // c.num_kv_heads)
    rows, hidden = x.shape
    eps = ctypes.c_float(c.rms_norm_eps)
    for i, layer in enumerate(model.layers):
        dense = path.dense[i]
        _check(lib.rms_norm(x.data_ptr(), rows, hidden, layer.attn_norm.data_ptr(), eps,
                            bufs.h.data_ptr()), "rms_norm")
        qkv = _project(dense.get("qkv"), layer.qkv, bufs.h, bufs.qkv, split)
        if layer.q_norm is not None:
            model._native_qk_norm(lib, layer, qkv, eps)
        _attend(model, lib, i, qkv, bufs.attn, batch, split, cos, sin, cache, step, index,
                scale)
        x += _project(dense.get("o"), layer.o, bufs.attn, bufs.proj, split)
        _check(lib.rms_norm(x.data_ptr(), rows, hidden, layer.mlp_norm.data_ptr(), eps,
                            bufs.h.data_ptr()), "rms_norm")
        gate_up = _project(dense.get("gate_up"), layer.gate_up, bufs.h, bufs.gu, split)
        _check(lib.silu_mul(gate_up.data_ptr(), rows, c.intermediate_size,
                            bufs.act.data_ptr()), "silu_mul")
        x += _project(dense.get("down"), layer.down, bufs.act, bufs.proj, split)


def _project(dense, native, x: torch.Tensor, out: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """The projection of `x` `[rows, in]` into `out` `[rows, out]`: prompt rows through `dense`
    (None: every row native), the others through the native layer."""
    if dense is None:
        return native.into(x, out)
    if split.other is None:
        return dense(x, out)
    out[split.prompt] = dense(x[split.prompt])
    out[split.other] = native(x[split.other])
    return out


def _attend(model, lib, layer: int, qkv: torch.Tensor, out: torch.Tensor, batch,
            split: RowSplit, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, step: int,
            index: KVIndex, scale: float) -> None:
    """Layer `layer`'s rotary embedding, cache writes and attention: qkv `[rows, (heads + 2
    kv_heads) · hd]` → out `[rows, heads · hd]`."""
    c = model.cfg
    heads, kv_heads, hd = c.num_heads, c.num_kv_heads, c.head_dim
    keys, values = cache.keys.data_ptr() + layer * step, cache.values.data_ptr() + layer * step
    if not split.segments:  # every row on the native glue
        _check(lib.rope_store_attend(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, hd,
                                     cos.data_ptr(), sin.data_ptr(), keys, values,
                                     *_where(index, scale, out)), "rope_store_attend")
        return
    rows = split.attend
    every = split.glue is None  # a pass of prompt rows alone: views, no gathers
    q, k, v = (qkv if every else qkv[rows]).split([heads * hd, kv_heads * hd, kv_heads * hd],
                                                  dim=-1)
    cs, sn = ((cos, sin) if every else (cos[rows], sin[rows]))
    cs, sn = cs[:, None], sn[:, None]  # [a, 1, hd]
    q = _rope(q.reshape(-1, heads, hd), cs, sn)  # [a, heads, hd]
    k = _rope(k.reshape(-1, kv_heads, hd), cs, sn)  # [a, kv_heads, hd]
    tables = batch.block_tables
    pos = batch.positions if every else batch.positions[rows]
    seqs = batch.row_seq if every else batch.row_seq[rows]
    block_of = tables[seqs.long(), pos // cache.block_size].long()
    cache.write(layer, block_of * cache.block_size + pos % cache.block_size, k,
                v.reshape(-1, kv_heads, hd))
    if split.glue is not None:  # the other rows store theirs and attend on the native glue
        _native_rows(lib, qkv, out, split.glue, batch, cos, sin, keys, values, index, scale,
                     (heads, kv_heads, hd))
    for seg in split.segments:
        attn = prefill_attention(q[seg.rows], cache.keys[layer], cache.values[layer],
                                 tables[seg.seq], seg.start, scale, seg.masks)
        if every:
            out[seg.rows] = attn.reshape(-1, heads * hd)
        else:
            out[rows[seg.rows]] = attn.reshape(-1, heads * hd)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as the PyTorch path and the native glue compute it (each product
    rounded, then the sum)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _native_rows(lib, qkv, out, rows, batch, cos, sin, keys, values, index, scale, dims):
    """`rope_store_attend` for the rows `rows` alone (their own row index)."""
    heads, kv_heads, hd = dims
    sub_qkv = qkv[rows].contiguous()
    seq32 = batch.row_seq[rows].to(torch.int32).contiguous()
    pos32 = batch.positions[rows].to(torch.int32).contiguous()
    sub = KVIndex(index.kv_kind, index.num_blocks, index.block_size, index.block_tables,
                  index.num_seqs, index.max_blocks, seq32.data_ptr(), pos32.data_ptr())
    sub_cos, sub_sin = cos[rows].contiguous(), sin[rows].contiguous()  # [n, hd]
    sub_out = torch.empty((rows.shape[0], heads * hd), dtype=torch.float32)
    _check(lib.rope_store_attend(sub_qkv.data_ptr(), rows.shape[0], heads, kv_heads, hd,
                                 sub_cos.data_ptr(), sub_sin.data_ptr(), keys, values,
                                 *_where(sub, scale, sub_out)), "rope_store_attend")
    out[rows] = sub_out


def _where(index: KVIndex, scale: float, out: torch.Tensor) -> tuple:
    return (index.kv_kind, index.num_blocks, index.block_size, index.block_tables,
            index.num_seqs, index.max_blocks, index.row_seq, index.row_pos,
            ctypes.c_float(scale), out.data_ptr())


def _check(rc: int, name: str) -> None:
    if rc == -3:
        raise ValueError(f"{name}: a sequence, position or block id out of range")
    if rc != 0:
        raise RuntimeError(f"native {name} failed (code {rc})")
