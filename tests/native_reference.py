"""A bit-exact reference of the native quantized matmul (`q_matmul` in
`specserve/kernels/qmatmul.c`, layout v4: the lanes kinds K4, K6, S6, B4, B6, B8 and the 8-bit
rows R8), written from the layout's specification and independent of `NativeWeights.codes` /
`dequantize`:

- `fields`: every weight's code, block scale and offset multipliers and steps read from
  `NativeWeights` byte by byte as the specification places them;
- `quantize_activations`: the kernel's `quantize_row` (per activation block of `ab` inputs:
  amax; da = amax/127 and qa = round-half-even(x·(127/amax)), both in float32);
- `fma32`: a float32 fused multiply-add (one rounding), emulated in float64;
- `matmul`: for each row and output, y = 0, then over the steps in order:
  K4, K6 (a step of g = min(sb, ab) inputs: weight super-block s, activation block a):
      I = Σ_b sc_b·Σ_i q_i·qa_i,  M = Σ_b m_b·Σ_i qa_i   (exact integers)
      y = fma32(float32(I), dsup_s·da_a, y);  y = fma32(float32(M), dmin_s·da_a, y)
  S6 (steps of g): I = Σ_b Σ_h sc_bh·(Σ_i∈h q_i·qa_i − zero·Σ_i∈h qa_i);  y = fma32(I, dsup_s·da_a, y)
  B4, B6, B8 (a step per block b): I = Σ_i q_i·qa_i − zero·Σ_i qa_i;  y = fma32(I, d_b·da_a, y)
      and, where the weights carry offsets, y = fma32(Σ_i qa_i, m_b·da_a, y)
  R8 (ab = sb): I_s = Σ_b sc_b·Σ_i q_i·qa_i;  y = fma32(float32(I_s), dsup_s·da_s, y)
  the products dsup·da (d·da, m·da) rounded to float32 once.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.weights.quant import (FLOAT_BLOCK_KINDS, KIND_R8, KIND_S6, NativeWeights,
                                     kind_act_block)

LANES = 16

def _per_output(field: torch.Tensor, t: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """A lanes field [T, x, 16] (or [T, x, 2, 16]) as [T·16, x] (or [T·16, 2x]) per output."""
    a = field.numpy()
    if a.ndim == 4:
        a = a.reshape(a.shape[0], -1, LANES)
    return a[t[:, 0], :, lane[:, 0]]

def fields(w: NativeWeights) -> dict[str, np.ndarray]:
    """Per output, as the specification lays them out: q [n, k] int64; sc [n, nb] (S6: [n, 2nb],
    half h of block b at 2b + h) and mins [n, nb] int64; dsup, dmin [n, nw] float32 (B: d, m
    [n, nb] float32 from float16); absent fields None; and, for the lanes kinds, `padding`:
    every byte and float of the lanes past n (all must be zero)."""
    n = w.out_features
    if w.kind == KIND_R8:
        return {"q": w.qs.numpy().astype(np.int64), "sc": w.sc.numpy().astype(np.int64),
                "dsup": w.dsup.numpy(), "mins": None, "dmin": None, "padding": np.zeros(0)}
    tiles, nb = w.qs.shape[:2]
    k = nb * 32
    o = np.arange(tiles * LANES)[:, None]  # [T·16, 1] every lane, padding included
    t, lane = o // LANES, o % LANES
    i = np.arange(k)[None]  # [1, k]
    b, within = i // 32, i % 32
    if w.bits == 8:  # chunk c = within // 4 holds inputs 4c..4c + 3, byte 4l + j
        q = w.qs.numpy()[t, b, within // 4, 4 * lane + within % 4].astype(np.int64)
    else:
        chunk, j = (within % 16) // 4, within % 4
        byte = w.qs.numpy()[t, b, chunk, 4 * lane + j].astype(np.int64)  # [T·16, k]
        q = (byte >> (4 * (within // 16))) & 15  # inputs 0..15: low nibble, 16..31: high
        if w.bits == 6:
            group = within // 4  # 0..7: chunk h = group // 4, bits 2·(group % 4)
            top = w.qh.numpy()[t, b, group // 4, 4 * lane + j].astype(np.int64)
            q = q | (((top >> (2 * (group % 4))) & 3) << 4)
    per_block = {name: _per_output(getattr(w, name), t, lane).astype(
                     np.float32 if name in ("dsup", "dmin") else np.int64)
                 for name in ("sc", "mins", "dsup", "dmin") if getattr(w, name) is not None}
    padding = np.concatenate([q[n:].ravel()] + [v[n:].ravel().astype(np.float64)
                                                for v in per_block.values()])
    out = {name: per_block[name][:n] if name in per_block else None
           for name in ("sc", "mins", "dsup", "dmin")}
    return {"q": q[:n], **out, "padding": padding}

def quantize_activations(x: torch.Tensor, ab: int) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, k] → (qa [rows, k] int64 in −127..127, da [rows, k/ab] float32), as the
    kernel's `quantize_row`: float32 throughout, round half to even."""
    rows, k = x.shape
    xs = x.float().reshape(rows, k // ab, ab)
    amax = xs.abs().amax(-1)  # [rows, nab] float32
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

def _f32(i: np.ndarray) -> np.ndarray:
    """Integers (exact in float64) rounded once to float32, as cvtdq2ps."""
    return i.astype(np.float64).astype(np.float32)

def matmul(x: torch.Tensor, w: NativeWeights, ab: int | None = None) -> torch.Tensor:
    """What q_matmul returns for x [rows, k] float32 (no bias), to the bit: [rows, n]. `ab`: the
    activation block (default: `NativeLinear`'s for these weights: R8 its sb, else
    `kind_act_block`)."""
    f = fields(w)
    rows, k = x.shape
    n, nb = w.out_features, k // 32
    ab = (w.sb if w.kind == KIND_R8 else kind_act_block(w.kind, k)) if ab is None else ab
    qa, da = quantize_activations(x, ab)
    blocks = qa.reshape(rows, nb, 32)
    q = f["q"].reshape(n, nb, 32)
    y = np.zeros((rows, n), dtype=np.float32)
    if w.kind in FLOAT_BLOCK_KINDS:
        dots = np.einsum("rbi,obi->rob", blocks, q)  # [rows, n, nb]
        sums = blocks.sum(-1)  # [rows, nb]
        for b in range(nb):
            a = da[:, b * 32 // ab, None]  # [rows, 1]
            step = f["dsup"][None, :, b] * a  # [rows, n] float32 multiply
            y = fma32(_f32(dots[..., b] - w.zero * sums[:, b, None]), step, y)
            if f["dmin"] is not None:
                y = fma32(_f32(np.broadcast_to(sums[:, b, None], y.shape)),
                          f["dmin"][None, :, b] * a, y)
        return torch.from_numpy(y)
    g = min(w.sb, ab)
    per = g // 32
    if w.kind == KIND_S6:
        halves = np.einsum("rbhi,obhi->robh", blocks.reshape(rows, nb, 2, 16),
                           q.reshape(n, nb, 2, 16))  # [rows, n, nb, 2]
        hsums = blocks.reshape(rows, nb, 2, 16).sum(-1)  # [rows, nb, 2]
        sc = f["sc"].reshape(n, nb, 2)
        terms = ((halves - w.zero * hsums[:, None]) * sc[None]).sum(-1)  # [rows, n, nb]
        offsets = None
    else:
        dots = np.einsum("rbi,obi->rob", blocks, q)  # [rows, n, nb]
        terms = dots * f["sc"][None]
        offsets = None if f["mins"] is None else blocks.sum(-1)[:, None, :] * f["mins"][None]
    for c in range(nb // per):
        s, a = c * g // w.sb, da[:, c * g // ab, None]
        step = f["dsup"][None, :, s] * a  # [rows, n] float32 multiply
        y = fma32(_f32(terms[..., c * per:(c + 1) * per].sum(-1)), step, y)
        if offsets is not None:
            y = fma32(_f32(offsets[..., c * per:(c + 1) * per].sum(-1)),
                      f["dmin"][None, :, s] * a, y)
    return torch.from_numpy(y)
