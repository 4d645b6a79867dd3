"""A bit-exact reference of the native quantized matmul (`q_matmul` in
`specserve/kernels/qmatmul.c`, layout v3 for 4 and 6 bits, v2 rows for 8), written from the
layout's specification and independent of `NativeWeights.codes`/`dequantize`:

- `fields`: every weight's code, block scale and offset multipliers and super-block steps
  read from `NativeWeights` byte by byte as the specification places them;
- `quantize_activations`: the kernel's `quantize_row` (per super-block amax; da = amax/127
  and qa = round-half-even(x·(127/amax)), both in float32);
- `fma32`: a float32 fused multiply-add (one rounding), emulated in float64;
- `matmul`: for each row and output, over the super-blocks s in order, y = 0 then
      I_s = Σ_b sc_b·Σ_i q_i·qa_i,  M_s = Σ_b m_b·Σ_i qa_i   (exact integers)
      y = fma32(float32(I_s), dsup_s·da_s, y);  y = fma32(float32(M_s), dmin_s·da_s, y)
  (8 bits: no M term), the products dsup_s·da_s rounded to float32 once.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.weights.quant import NativeWeights

LANES = 16


def fields(w: NativeWeights) -> dict[str, np.ndarray]:
    """Per output, as the specification lays them out: q [n, k] int64 and sc, mins [n, nb]
    int64, dsup, dmin [n, ns] float32 (mins, dmin: None for 8 bits); and, for 4 and 6 bits,
    `padding`: every byte and float of the lanes past n (all must be zero)."""
    n, k, nb = w.out_features, w.sc.shape[1] * 32, w.sc.shape[1]
    if w.bits == 8:
        return {"q": w.qs.numpy().astype(np.int64), "sc": w.sc.numpy().astype(np.int64),
                "dsup": w.dsup.numpy(), "mins": None, "dmin": None, "padding": np.zeros(0)}
    tiles = w.qs.shape[0]
    o = np.arange(tiles * LANES)[:, None]  # [T·16, 1] every lane, padding included
    t, lane = o // LANES, o % LANES
    i = np.arange(k)[None]  # [1, k]
    b, within = i // 32, i % 32
    chunk, j = (within % 16) // 4, within % 4
    byte = w.qs.numpy()[t, b, chunk, 4 * lane + j].astype(np.int64)  # [T·16, k]
    q = (byte >> (4 * (within // 16))) & 15  # inputs 0..15: low nibble, 16..31: high
    if w.bits == 6:
        group = within // 4  # 0..7: chunk h = group // 4, bits 2·(group % 4)
        top = w.qh.numpy()[t, b, group // 4, 4 * lane + j].astype(np.int64)
        q = q | (((top >> (2 * (group % 4))) & 3) << 4)
    per_block = {name: getattr(w, name).numpy()[t[:, 0], :, lane[:, 0]]
                 for name in ("sc", "mins", "dsup", "dmin")}  # [T·16, nb or ns]
    padding = np.concatenate([q[n:].ravel()] + [v[n:].ravel().astype(np.float64)
                                                for v in per_block.values()])
    out = {name: v[:n] for name, v in per_block.items()}
    out["sc"], out["mins"] = out["sc"].astype(np.int64), out["mins"].astype(np.int64)
    assert out["sc"].shape == (n, nb)
    return {"q": q[:n], **out, "padding": padding}


def quantize_activations(x: torch.Tensor, sb: int) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, k] → (qa [rows, k] int64 in −127..127, da [rows, k/sb] float32), as the
    kernel's `quantize_row`: float32 throughout, round half to even."""
    rows, k = x.shape
    xs = x.float().reshape(rows, k // sb, sb)
    amax = xs.abs().amax(-1)  # [rows, ns] float32
    # float32 127.0f / max, correctly rounded: a tensor over a tensor (`127 / amax`, a Python
    # number over a tensor, is computed another way and can differ in the last bit)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qa = torch.round(xs * inv[..., None]).clamp(-128, 127)  # the int8 packs saturate
    return qa.reshape(rows, k).numpy().astype(np.int64), (amax / 127).numpy()


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a·b + c with one rounding (a, b, c float32, finite, no float32 overflow).

    a·b is exact in float64 (24 + 24 ≤ 53 significant bits). Rounding a·b + c to float64 and
    then to float32 could round twice wrongly (a·b a float32 midpoint, c tiny), so the
    float64 sum is made round-to-odd instead: TwoSum gives its exact error e, and an inexact
    sum with an even last bit moves to its odd neighbour on e's side. Rounding a
    round-to-odd result of precision 53 ≥ 24 + 2 to nearest float32 equals rounding the
    exact value once (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
    proved algorithms using rounding to odd", IEEE TC 2008)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    v = s - p
    e = (p - (s - v)) + (c - v)  # TwoSum: s + e == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    odd = np.nextafter(s, np.where(e > 0, np.inf, -np.inf))
    return np.where((e != 0) & even, odd, s).astype(np.float32)


def matmul(x: torch.Tensor, w: NativeWeights) -> torch.Tensor:
    """What q_matmul returns for x [rows, k] float32 (no bias), to the bit: [rows, n]."""
    f = fields(w)
    rows, k = x.shape
    n, nb, per = w.out_features, k // 32, w.sb // 32
    ns = nb // per
    qa, da = quantize_activations(x, w.sb)
    blocks = qa.reshape(rows, nb, 32)
    dots = np.einsum("rbi,obi->rob", blocks, f["q"].reshape(n, nb, 32))  # [rows, n, nb] int64
    integer = (dots * f["sc"][None]).reshape(rows, n, ns, per).sum(-1)  # [rows, n, ns] I_s
    if f["mins"] is not None:
        offset = (blocks.sum(-1)[:, None, :] * f["mins"][None]).reshape(rows, n, ns, per).sum(-1)
    y = np.zeros((rows, n), dtype=np.float32)
    for s in range(ns):
        step = f["dsup"][None, :, s] * da[:, s, None]  # [rows, n] float32 multiply
        y = fma32(integer[..., s].astype(np.float64).astype(np.float32), step, y)
        if f["mins"] is not None:
            step = f["dmin"][None, :, s] * da[:, s, None]
            y = fma32(offset[..., s].astype(np.float64).astype(np.float32), step, y)
    return torch.from_numpy(y)
