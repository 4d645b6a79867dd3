"""GGUF tensor dequantization to float32 with vectorized torch ops.

A GGUF tensor is a sequence of fixed-size *blocks* laid out along its contiguous (last)
dimension; each block packs `block_size` weights into `type_size` bytes. The layouts below
follow ggml's `ggml-quants.c` (mirrored by the `gguf` package's `gguf/quants.py`, which is
the numerical reference in the tests). All multi-byte fields are little-endian.

    Q8_0  (32 weights, 34 B):  d:f16, qs:int8[32]                       w = d * q
    Q4_0  (32 weights, 18 B):  d:f16, qs:u8[16]                         w = d * (q - 8)
    Q4_1  (32 weights, 20 B):  d:f16, m:f16, qs:u8[16]                  w = d * q + m
    Q5_0  (32 weights, 22 B):  d:f16, qh:u8[4], qs:u8[16]               w = d * (q - 16)
    Q5_1  (32 weights, 24 B):  d:f16, m:f16, qh:u8[4], qs:u8[16]        w = d * q + m
    Q4_K (256 weights, 144 B): d:f16, dmin:f16, scales:u8[12], qs:u8[128]
    Q5_K (256 weights, 176 B): d:f16, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]
    Q6_K (256 weights, 210 B): ql:u8[128], qh:u8[64], scales:int8[16], d:f16

In the 32-weight formats the low nibble of qs[i] is weight i and the high nibble weight
i + 16; bit j of qh is the fifth bit of weight j. The K formats split a block into
sub-blocks with their own 6-bit (Q4_K, Q5_K: 8 x 32 weights, w = d*sc*q - dmin*m) or
8-bit (Q6_K: 16 x 16 weights, w = d*sc*(q - 32)) scales.

Work happens in uint8/int8 and float32 on bounded chunks of blocks, written into one
preallocated output, so memory stays near the size of the result. Arithmetic is done in
the same order as the reference (no fused multiply-add), so results match it bit for bit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor

Q = GGMLQuantizationType
BlockDecoder = Callable[[torch.Tensor], torch.Tensor]

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

# Blocks decoded per step: bounds the temporaries to a few MiB whatever the tensor size.
_CHUNK_WEIGHTS = 1 << 18


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte `offset` of each block, as float32."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()  # [n, 1]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles then high nibbles of each row of bytes: [n, b] -> [n, 2, b]."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)  # [n, 2, b]


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit j of each row of bytes (little-endian bit order): [n, b] -> [n, count, b]."""
    shifts = torch.arange(count, dtype=torch.uint8).view(1, count, 1)
    return (qh.unsqueeze(1) >> shifts) & 1  # [n, count, b]


def _decode_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)  # [n, 1]


def _decode_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()  # [n, 1]


def _decode_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()  # [n, 1]


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
    return q * _f16(blocks, 0)


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 2:]).view(n, 32).to(torch.int8) - 8  # [n, 32]
    return _f16(blocks, 0) * q.float()


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:]).view(n, 32).float()  # [n, 32]
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values of the 32-weight formats from qh [n, 4] and qs [n, 16]."""
    n = qs.shape[0]
    high = _bits(qh, 8).transpose(1, 2).reshape(n, 32)  # [n, 32]; bit j of byte k -> 8k + j
    return _nibbles(qs).view(n, 32) | (high << 4)  # [n, 32]


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:]).to(torch.int8) - 16  # [n, 32]
    return _f16(blocks, 0) * q.float()


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:]).float()  # [n, 32]
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K from 12 packed bytes.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7
    hold mins 0-3 and the top bits of mins 4-7; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    s = scales.reshape(-1, 3, 4)  # [n, 3, 4]
    lo_sc, lo_m, packed = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat((lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)), dim=1)  # [n, 8]
    mn = torch.cat((lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)), dim=1)  # [n, 8]
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K sub-block scales and mins to q [n, 8, 32]."""
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.float()).view(n, 8, 1)  # [n, 8, 1]
    offset = (_f16(blocks, 2) * mn.float()).view(n, 8, 1)  # [n, 8, 1]
    return (scale * q.float() - offset).view(n, 256)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Each 32-byte group of qs gives two sub-blocks: low nibbles, then high nibbles.
    q = _nibbles(blocks[:, 16:].reshape(n * 4, 32)).view(n, 8, 32)  # [n, 8, 32]
    return _k_affine(blocks, q)


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).view(n, 8, 32)  # [n, 8, 32]
    high = _bits(blocks[:, 16:48], 8)  # [n, 8, 32]; bit i of qh[l] -> sub-block i
    return _k_affine(blocks, low | (high << 4))


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Per 128-weight half: ql bytes [0:32], [32:64] low nibbles, then their high nibbles;
    # qh 2-bit fields (shift 0, 2, 4, 6) in the same order.
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    ql = (ql & 0x0F).view(n, 8, 32)  # [n, 8, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).view(n, 8, 32)  # [n, 8, 32]
    q = ((ql | (qh << 4)).view(torch.int8) - 32).view(n, 16, 16)  # [n, 16, 16]
    scales = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    scale = (_f16(blocks, 208) * scales).view(n, 16, 1)  # [n, 16, 1]
    return (scale * q.float()).view(n, 256)


_DECODERS: dict[GGMLQuantizationType, BlockDecoder] = {
    Q.F32: _decode_f32,
    Q.F16: _decode_f16,
    Q.BF16: _decode_bf16,
    Q.Q8_0: _decode_q8_0,
    Q.Q4_0: _decode_q4_0,
    Q.Q4_1: _decode_q4_1,
    Q.Q5_0: _decode_q5_0,
    Q.Q5_1: _decode_q5_1,
    Q.Q4_K: _decode_q4_k,
    Q.Q5_K: _decode_q5_k,
    Q.Q6_K: _decode_q6_k,
}
assert frozenset(_DECODERS) == SUPPORTED_TYPES


def _resolve_type(qtype: GGMLQuantizationType | int, label: str) -> GGMLQuantizationType:
    try:
        resolved = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown GGUF tensor type {qtype!r} for tensor {label}") from None
    if resolved not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"unsupported GGUF tensor type {resolved.name} for tensor {label} (supported: {supported})"
        )
    return resolved


def _expected_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...], label: str) -> int:
    if any(not isinstance(dim, (int, np.integer)) or dim < 0 for dim in shape):
        raise ValueError(f"shape of tensor {label} must be non-negative integers, got {shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    last = shape[-1] if shape else 1
    if last % block_size != 0:
        raise ValueError(
            f"shape of tensor {label}: last dimension {last} is not a multiple of the "
            f"{qtype.name} block size {block_size}"
        )
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def dequantize(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    name: str | None = None,
) -> torch.Tensor:
    """Decode the bytes of one GGUF tensor into a float32 tensor of `shape`.

    `shape` is in PyTorch order (the reverse of GGUF's `ne`); blocks run along its last
    dimension. `raw` may be a uint8 array or an already-typed F32/F16/BF16 array (as
    `gguf.GGUFReader` exposes them); it is read as raw bytes either way.
    """
    label = name if name is not None else "<unnamed>"
    qtype = _resolve_type(qtype, label)
    shape = tuple(int(dim) for dim in shape)
    expected = _expected_bytes(qtype, shape, label)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)  # [bytes]
    if data.size != expected:
        raise ValueError(
            f"corrupt or truncated tensor {label}: {qtype.name} shape {shape} needs "
            f"{expected} bytes, got {data.size}"
        )
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = expected // type_size
    out = torch.empty(n_blocks, block_size, dtype=torch.float32)  # [n_blocks, block_size]
    blocks = data.reshape(n_blocks, type_size)  # [n_blocks, type_size]
    decode = _DECODERS[qtype]
    step = max(1, _CHUNK_WEIGHTS // block_size)
    for start in range(0, n_blocks, step):
        chunk = torch.from_numpy(np.array(blocks[start : start + step]))  # [step, type_size]
        out[start : start + step] = decode(chunk)
    return out.view(shape)


def dequantize_tensor(reader_tensor: ReaderTensor, name: str | None = None) -> torch.Tensor:
    """Dequantize a `gguf.ReaderTensor`, taking its type and (reversed) shape from it."""
    shape = tuple(int(dim) for dim in reversed(reader_tensor.shape))
    label = name if name is not None else reader_tensor.name
    return dequantize(reader_tensor.data, reader_tensor.tensor_type, shape, name=label)
