"""The prefill path: a prompt's rows through oneDNN, the library behind PyTorch's bfloat16
matmul and its CPU flash attention (it picks AMX on recent Xeons, AVX-512 BF16 on Zen 4, AVX2
elsewhere, at run time), beside the int4 kernels, which keep every decode and verify row.

`PrefillChoice` says which parts of a pass take it for prompt rows: some of a layer's four
projections (`DenseProjection`: bfloat16 weights made from the file's own dequantization) and
attention from some prompt position on (`prefill_attention`). The engine times both paths on
the model's own shapes at start-up and sets the faster (`engine/prefill_choice.py`); the
native choice (`NATIVE`) changes nothing. Why: docs/design.md, "Prefill on oneDNN".

A prompt's keys and values must not depend on what else shares its chunk, nor on how it was
cut into chunks (the budget left by other requests decides that). So a prompt row takes one
path whatever its chunk (per projection, never per row count; attention by the row's own
position), and neither path lets the other rows change a row's arithmetic:
- `DenseProjection` pads the rows to a multiple of `ROW_TILE` (PyTorch sends a one-row bf16
  matmul to a kernel of other bits; padded, every call is a GEMM whose rows sit in full
  blocks);
- `prefill_attention` attends in key blocks of `KV_BLOCK` positions at fixed absolute offsets
  (the last one padded to full width and masked), one flash-attention call per block over the
  rows that reach it (padded to a multiple of `Q_TILE`: a call's last few query rows would
  otherwise take a kernel of other bits), and merges the blocks in order by their
  log-sum-exp, in float32.
tests/models/test_prefill_path.py checks both on the machine it runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a decoder layer's projections, in pass order
ROW_TILE = 16  # a dense projection's rows are padded to a multiple of this
KV_BLOCK = 512  # positions per key block of `prefill_attention` (from position 0 on)
Q_TILE = 32  # a flash-attention call's query rows are padded to a multiple of this
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """What of a prefill pass runs on oneDNN: `projections` (a subset of `PROJECTIONS`) for
    prompt rows, and attention for prompt rows at positions >= `attention_from` (None:
    never). `timings`: what the choice was made from (seconds per path, see
    `engine/prefill_choice.py`), or empty where it was forced; `disturbed`: other work on the
    machine disturbed them (then nothing was moved to oneDNN)."""

    projections: tuple[str, ...] = ()
    attention_from: int | None = None
    timings: tuple = ()
    disturbed: bool = False

    def __post_init__(self) -> None:
        unknown = [p for p in self.projections if p not in PROJECTIONS]
        if unknown:
            raise ValueError(f"projections must be among {PROJECTIONS}, got {unknown}")
        if self.attention_from is not None and self.attention_from < 0:
            raise ValueError(f"attention_from must be >= 0 or None, got {self.attention_from}")

    @property
    def active(self) -> bool:
        """Whether anything runs on oneDNN."""
        return bool(self.projections) or self.attention_from is not None

    def parts(self) -> dict[str, bool]:
        """Each projection and "attention": True where it runs on oneDNN (attention from some
        position on)."""
        return {**{p: p in self.projections for p in PROJECTIONS},
                "attention": self.attention_from is not None}

    def label(self) -> str:
        """E.g. "onednn: qkv, o, gate_up, down; attention from 0" or "native"."""
        if not self.active:
            return "native"
        parts = list(self.projections)
        if self.attention_from is not None:
            parts.append(f"attention from position {self.attention_from}")
        return "onednn: " + ", ".join(parts)


NATIVE = PrefillChoice()
ONEDNN = PrefillChoice(PROJECTIONS, 0)  # everything a prefill pass can run there (forced)


@dataclass(frozen=True, slots=True)
class PrefillPath:
    """A model's prefill path: its `choice` and, per layer, the dense projections it names."""

    choice: PrefillChoice
    dense: tuple[dict[str, "DenseProjection"], ...]  # [num_layers] attribute → projection

    @property
    def nbytes(self) -> int:
        """Bytes of the dense weights (beside the int4 ones)."""
        return sum(d.nbytes for layer in self.dense for d in layer.values())

    @staticmethod
    def build(choice: PrefillChoice, layers: list, dense_weights) -> "PrefillPath":
        """The dense projections `choice` names for every layer of `layers`, each from
        `dense_weights(i, attribute)` (the file's own dequantization, float) with its layer's
        bias."""
        if choice.projections and dense_weights is None:
            raise ValueError("this model keeps no dense source of its weights: its projections "
                             "cannot take the prefill path (prefill_path='native')")
        return PrefillPath(choice, tuple(
            {attr: DenseProjection(dense_weights(i, attr), getattr(layer, attr).bias)
             for attr in choice.projections} for i, layer in enumerate(layers)))


class DenseProjection:
    """A projection's weights `[out, in]` in bfloat16 on PyTorch's matmul (oneDNN), its bias
    in float32: float32 rows in, float32 rows out (the activations are rounded to bfloat16 on
    the way in, the products accumulate in float32 and come back rounded to bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.to(torch.bfloat16).contiguous()  # [out, in]
        self.bias = None if bias is None else bias.float().contiguous()  # [out]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[rows, in]` → `[rows, out]` float32 (written into `out` where given)."""
        rows = x.shape[0]
        if rows % ROW_TILE:
            padded = torch.zeros((-(-rows // ROW_TILE) * ROW_TILE, self.in_features),
                                 dtype=torch.bfloat16)  # [rows rounded up, in]
            padded[:rows] = x
        else:
            padded = x.to(torch.bfloat16)
        y = F.linear(padded, self.weight)[:rows]  # [rows, out] bfloat16
        out = y.float() if out is None else out.copy_(y)
        if self.bias is not None:
            out += self.bias
        return out


def attention_masks(start: int, n: int, group: int) -> list[torch.Tensor]:
    """The additive masks `prefill_attention` needs for rows at positions start..start+n-1,
    per key block: `[1, 1, group · r, KV_BLOCK]` bfloat16 for the r rows reaching the block
    (0 where a row sees the key, −inf where not); the blocks wholly before `start` share one
    zero mask. Made once per pass and reused by every layer."""
    end = start + n
    pos = torch.arange(start, end)  # [n]
    whole = start // KV_BLOCK  # blocks 0..whole-1 lie wholly before start: every row sees them
    masks = [torch.zeros((1, 1, _padded(group * n), KV_BLOCK), dtype=torch.bfloat16)] * whole
    for j in range(whole, -(-end // KV_BLOCK)):
        lo = max(0, j * KV_BLOCK - start)  # the first row reaching block j
        keys = torch.arange(j * KV_BLOCK, (j + 1) * KV_BLOCK)  # [KV_BLOCK]
        m = torch.where(keys[None, :] <= pos[lo:, None], 0.0, float("-inf"))  # [r, KV_BLOCK]
        m = m.to(torch.bfloat16).repeat(group, 1)  # [group · r, KV_BLOCK]
        padded = torch.zeros((1, 1, _padded(m.shape[0]), KV_BLOCK), dtype=torch.bfloat16)
        padded[0, 0, :m.shape[0]] = m  # the padding rows see every key (no empty softmax)
        masks.append(padded)
    return masks


def _padded(rows: int) -> int:
    return -(-rows // Q_TILE) * Q_TILE


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      blocks: torch.Tensor, start: int, scale: float | None = None,
                      masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of the n consecutive rows of one sequence at positions
    start..start+n-1 (their keys and values already stored), in bfloat16 on PyTorch's CPU
    flash attention: q `[n, heads, hd]` float32 (rotated); one layer's pools `[num_blocks,
    kv_heads, block_size, hd]`; `blocks` the sequence's block ids (reaching position
    start + n − 1); `masks` from `attention_masks` (made here if None). Returns `[n, heads,
    hd]` float32. Query head h reads KV head h // (heads / kv_heads)."""
    n, heads, hd = q.shape
    kv_heads, bs = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    end = start + n
    num = -(-end // KV_BLOCK)
    scale = 1 / math.sqrt(hd) if scale is None else scale
    masks = attention_masks(start, n, group) if masks is None else masks
    ids = blocks[:-(-end // bs)].long()
    keys, values = (_gathered(pool, ids, end, num * KV_BLOCK) for pool in (k_pool, v_pool))
    qh = q.to(torch.bfloat16).reshape(n, kv_heads, group, hd).permute(1, 2, 0, 3)  # [kv, g, n, hd]
    outs, lses, made = [], [], {}
    for j in range(num):
        lo = max(0, j * KV_BLOCK - start)
        r = n - lo
        keep = slice(j * KV_BLOCK, (j + 1) * KV_BLOCK)
        if lo not in made:  # the rows reaching block j, padded (blocks before start share them)
            made[lo] = torch.zeros((1, kv_heads, _padded(group * r), hd), dtype=torch.bfloat16)
            made[lo][0, :, :group * r] = qh[:, :, lo:].reshape(kv_heads, group * r, hd)
        out, lse = _flash(made[lo], keys[:, :, keep], values[:, :, keep], attn_mask=masks[j],
                          scale=scale)
        outs.append(out[0, :, :group * r].reshape(kv_heads, group, r, hd).float())
        lses.append(lse[0, :, :group * r].reshape(kv_heads, group, r))
    return _merge(outs, lses, n).permute(2, 0, 1, 3).reshape(n, heads, hd)


def _gathered(pool: torch.Tensor, ids: torch.Tensor, end: int, width: int) -> torch.Tensor:
    """Positions 0..end-1 of a sequence from one layer's pool, as `[1, kv_heads, width, hd]`
    bfloat16 (zeros past `end`)."""
    kv_heads, hd = pool.shape[1], pool.shape[3]
    out = torch.empty((1, kv_heads, width, hd), dtype=torch.bfloat16)
    out[0, :, :end] = pool[ids].transpose(0, 1).reshape(kv_heads, -1, hd)[:, :end]
    out[0, :, end:] = 0
    return out


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor], n: int) -> torch.Tensor:
    """Block results (block j's covering the last r_j of n rows) → `[kv, g, n, hd]`: each
    row's weighted mean by exp(lse − max lse), blocks added in order (elementwise per row)."""
    kv, g, _, hd = outs[0].shape
    top = torch.full((kv, g, n), float("-inf"))
    for lse in lses:
        part = top[:, :, n - lse.shape[2]:]
        torch.maximum(part, lse, out=part)
    total = torch.zeros((kv, g, n))
    acc = torch.zeros((kv, g, n, hd))
    for out, lse in zip(outs, lses):
        lo = n - lse.shape[2]
        w = torch.exp(lse - top[:, :, lo:])  # [kv, g, r]
        total[:, :, lo:] += w
        acc[:, :, lo:] += w[..., None] * out
    return acc / total[..., None]
