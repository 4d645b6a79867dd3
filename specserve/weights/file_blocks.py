"""The file's own blocks on the native kernels: each GGUF quantization type repacked into a
kernel layout (`quant.NativeWeights`) with the codes and scales the file stores, never
quantized again on a new grid.

    Q4_K → K4 (sb 256): dsup = d, sc = the 6-bit scale, dmin = −dmin, mins = the 6-bit min
    Q5_K → K6: the same, the 5-bit codes in the 6-bit layout
    Q6_K → S6 (sb 256, zero 32): dsup = d, sc = the int8 scale of each 16 inputs
    Q4_0 → B4 (zero 8), Q4_1 → B4 (m), Q5_0 → B6 (zero 16), Q5_1 → B6 (m),
    Q8_0 → B8 (codes q + 128, zero 128): d (and m) float16 per block of 32

so that a layout's `dequantize()` equals the `gguf` package's dequantization bit for bit
(tests/weights/test_file_blocks.py), and the kernel computes with exactly those weights: its
integer sums are exact, its float steps the file's scales times the activations' (the
arithmetic of llama.cpp's Q4_K × Q8_K and Q6_K × Q8_K dot products).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from specserve.weights.dequant import block_fields
from specserve.weights.quant import (KIND_B4, KIND_B6, KIND_B8, KIND_K4, KIND_K6, KIND_R8,
                                     KIND_S6,
                                     LANES, NativeWeights, _pack_bytes, _pack_lanes, _tile)

# type → (kind, code offset): what each quantized type becomes
KINDS = {Q.Q4_K: (KIND_K4, 0), Q.Q5_K: (KIND_K6, 0), Q.Q6_K: (KIND_S6, 32),
         Q.Q4_0: (KIND_B4, 8), Q.Q4_1: (KIND_B4, 0), Q.Q5_0: (KIND_B6, 16),
         Q.Q5_1: (KIND_B6, 0), Q.Q8_0: (KIND_B8, 128)}
KIND_NAMES = {KIND_K4: "4-bit", KIND_K6: "6-bit", KIND_S6: "6-bit, scales per 16",
              KIND_B4: "4-bit, f16 scales", KIND_B6: "6-bit, f16 scales",
              KIND_B8: "8-bit, f16 scales"}
_ROWS = 4096  # rows repacked at a time (a multiple of 16: whole tiles), bounding temporaries


def carries(qtype: Q) -> bool:
    """Whether tensors of `qtype` go to the kernels as the file's own blocks."""
    return qtype in KINDS


def native_blocks(raw: np.ndarray | torch.Tensor, qtype: Q, rows: int,
                  cols: int) -> NativeWeights:
    """The tensor whose bytes are `raw` ([rows, row bytes] or flat; rows × cols weights of
    `qtype`) in its kind's layout, `_ROWS` rows at a time."""
    if qtype not in KINDS:
        raise ValueError(f"{Q(qtype).name} tensors are not carried as blocks")
    data = torch.as_tensor(np.array(raw)).view(torch.uint8).reshape(rows, -1)  # a copy
    parts = [_repack(data[r:r + _ROWS], qtype, cols) for r in range(0, rows, _ROWS)]
    return parts[0] if len(parts) == 1 else concat(parts)


def concat(parts: list[NativeWeights]) -> NativeWeights:
    """Weights of one kind stacked output-wise (lanes kinds: every part but the last whole
    tiles)."""
    first = parts[0]
    if any(p.kind != first.kind or p.sb != first.sb or p.zero != first.zero for p in parts) \
            or (first.kind != KIND_R8 and any(p.out_features % LANES for p in parts[:-1])):
        raise ValueError("only whole tiles of one kind stack")

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return NativeWeights(first.kind, sum(p.out_features for p in parts), first.sb, cat("qs"),
                         cat("sc"), cat("dsup"), cat("mins"), cat("dmin"), cat("qh"), first.zero)


def _repack(data: torch.Tensor, qtype: Q, cols: int) -> NativeWeights:
    """Rows of blocks [n, row bytes] → their kind's layout."""
    n = data.shape[0]
    block, size = GGML_QUANT_SIZES[qtype]
    codes, f = block_fields(data.reshape(-1, size), qtype)
    kind, zero = KINDS[qtype]
    nb = cols // 32
    if qtype == Q.Q8_0:
        codes = (codes.to(torch.int16) + 128).to(torch.uint8)  # u = q + 128
    codes = codes.reshape(n, cols)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [n·blocks, x] → [n, blocks·x]
        return t.reshape(n, -1)

    if kind in (KIND_B4, KIND_B6, KIND_B8):  # d (and m) per block of 32
        qs, qh = (_pack_bytes(codes), None) if kind == KIND_B8 else _pack_lanes(codes, 4 if kind == KIND_B4 else 6)
        m = _tile(per_row(f["m"])) if "m" in f else None
        return NativeWeights(kind, n, 32, qs, None, _tile(per_row(f["d"])), None, m, qh, zero)
    qs, qh = _pack_lanes(codes, 4 if kind == KIND_K4 else 6)
    d = _tile(per_row(f["d"]).float())  # [T, cols/256, 16]
    if kind == KIND_S6:  # sc per 16 inputs: [n, 2·nb] → [T, nb, 2, 16]
        sc = _tile(per_row(f["sc"])).reshape(-1, nb, 2, LANES)
        return NativeWeights(kind, n, block, qs, sc.contiguous(), d, None, None, qh, zero)
    return NativeWeights(kind, n, block, qs, _tile(per_row(f["sc"])),
                         d, _tile(per_row(f["m"]).view(torch.int8)),
                         _tile(-per_row(f["dmin"]).float()), qh, zero)
