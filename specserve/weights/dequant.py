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

Bits are unpacked two or four bytes at a time in int16/int32 words (masks keep the bytes
apart), then widened straight into float32. Large tensors are decoded in chunks of blocks
written into one preallocated output, so temporaries stay a few MiB whatever the tensor
size. Arithmetic is done in the same order as the reference (no fused multiply-add), so
results match it bit for bit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
# Decodes blocks [n, type_size] (contiguous uint8) into out [n, block_size] float32.
BlockDecoder = Callable[[torch.Tensor, torch.Tensor], None]

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

# Weights decoded per step: bounds temporaries (~4 MiB of codes, 16 MiB of output slice)
# while keeping the number of torch op launches, each a thread-pool sync, small.
_CHUNK_WEIGHTS = 1 << 22


def _half(words: torch.Tensor, index: int) -> torch.Tensor:
    """The float16 field at int16 word `index` of each block, as float32."""
    return words[:, index : index + 1].view(torch.float16).float()  # [n, 1]


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """Low nibbles, then high nibbles, of the 2w bytes in words [..., w] (int16).

    Works on two bytes per element; the masks keep each byte's nibbles apart.
    """
    q = torch.empty(*words.shape[:-1], 2, words.shape[-1], dtype=torch.int16)  # [..., 2, w]
    torch.bitwise_and(words, 0x0F0F, out=q[..., 0, :])
    torch.bitwise_and(words >> 4, 0x0F0F, out=q[..., 1, :])
    return q.view(torch.uint8)  # [..., 2, 2w]


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """16 where bit j of byte qh[..., k] is set, else 0: uint8 [n, b] -> [n, b, 8]."""
    bits = (torch.arange(256, dtype=torch.int16).view(256, 1) >> torch.arange(8, dtype=torch.int16)) & 1
    table = (bits << 4).to(torch.uint8)  # [256, 8]
    return table[qh.long()]  # [n, b, 8]


def _decode_f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float32))


def _decode_f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def _decode_bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.bfloat16))


def _decode_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    d = _half(blocks.view(torch.int16), 0)  # [n, 1]
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(d)


def _decode_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    words = blocks.view(torch.int16)  # [n, 9]
    q = _nibbles(words[:, 1:]).view(-1, 32)  # [n, 32]
    out.copy_(q)
    out.sub_(8.0).mul_(_half(words, 0))


def _decode_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    words = blocks.view(torch.int16)  # [n, 10]
    q = _nibbles(words[:, 2:]).view(-1, 32)  # [n, 32]
    out.copy_(q)
    out.mul_(_half(words, 0)).add_(_half(words, 1))


def _five_bit(blocks: torch.Tensor, qh_byte: int) -> torch.Tensor:
    """5-bit values [n, 32] of Q5_0/Q5_1: qh is 4 bytes at `qh_byte`, qs the 16 after."""
    low = _nibbles(blocks.view(torch.int16)[:, qh_byte // 2 + 2 :]).view(-1, 32)  # [n, 32]
    high = _fifth_bits(blocks[:, qh_byte : qh_byte + 4]).view(-1, 32)  # [n, 32]; byte k bit j -> 8k + j
    return low | high


def _decode_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_five_bit(blocks, 2))
    out.sub_(16.0).mul_(_half(blocks.view(torch.int16), 0))


def _decode_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    words = blocks.view(torch.int16)  # [n, 12]
    out.copy_(_five_bit(blocks, 4))
    out.mul_(_half(words, 0)).add_(_half(words, 1))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins [n, 8] of Q4_K/Q5_K, as float32."""
    sc, mn = _k_scale_bytes(blocks)
    return sc.float(), mn.float()


def _k_scale_bytes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins [n, 8] uint8 of Q4_K/Q5_K (bytes 4..16).

    Bytes 4-7 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 8-11
    hold mins 0-3 and the top bits of mins 4-7; bytes 12-15 hold the low 4 bits of
    scales 4-7 (low nibbles) and mins 4-7 (high nibbles). Each int32 word below carries
    four of these bytes side by side; the masks keep them apart.
    """
    lo_sc, lo_m, mixed = blocks.view(torch.int32)[:, 1:4].unbind(1)  # [n] each
    top = 0x30303030
    sc = torch.stack((lo_sc & 0x3F3F3F3F, (mixed & 0x0F0F0F0F) | ((lo_sc >> 2) & top)), dim=1)  # [n, 2]
    mn = torch.stack((lo_m & 0x3F3F3F3F, ((mixed >> 4) & 0x0F0F0F0F) | ((lo_m >> 2) & top)), dim=1)
    return sc.view(torch.uint8), mn.view(torch.uint8)  # [n, 8] each


def _k_affine(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """out = (d * sc) * q - dmin * m for Q4_K/Q5_K, with q [n, 8, 32] the 4/5-bit values."""
    words = blocks.view(torch.int16)
    sc, mn = _k_scales(blocks)
    scale = (_half(words, 0) * sc).unsqueeze(-1)  # [n, 8, 1]
    offset = (_half(words, 1) * mn).unsqueeze(-1)  # [n, 8, 1]
    sub_blocks = out.view(-1, 8, 32)  # [n, 8, 32]
    sub_blocks.copy_(q)
    sub_blocks.mul_(scale).sub_(offset)


def _k_low_nibbles(words: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K qs (64 words) to [n, 8, 32]: each 32-byte group gives two sub-blocks."""
    return _nibbles(words.reshape(-1, 4, 16)).view(-1, 8, 32)  # [n, 8, 32]


def _decode_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _k_low_nibbles(blocks.view(torch.int16)[:, 8:72])  # [n, 8, 32]
    _k_affine(blocks, q, out)


def _decode_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    low = _k_low_nibbles(blocks.view(torch.int16)[:, 24:88])  # [n, 8, 32]
    high = _fifth_bits(blocks[:, 16:48]).transpose(1, 2)  # [n, 8, 32]; bit i of qh[l] -> sub-block i
    _k_affine(blocks, low | high, out)


def _q6_k_high(qh: torch.Tensor) -> torch.Tensor:
    """Bits 4-5 of the Q6_K values from qh words [n, 2, 16]: shifts 0, 2, 4, 6 in order."""
    high = torch.empty(*qh.shape[:2], 4, qh.shape[2], dtype=torch.int16)  # [n, 2, 4, 16]
    torch.bitwise_and(qh << 4, 0x3030, out=high[:, :, 0])
    torch.bitwise_and(qh << 2, 0x3030, out=high[:, :, 1])
    torch.bitwise_and(qh, 0x3030, out=high[:, :, 2])
    torch.bitwise_and(qh >> 2, 0x3030, out=high[:, :, 3])
    return high.view(torch.uint8).view(-1, 8, 32)  # [n, 8, 32]


def _decode_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    words = blocks.view(torch.int16)  # [n, 105]
    # Per 128-weight half: low nibbles of ql bytes 0..63, then their high nibbles.
    low = _nibbles(words[:, :64].reshape(-1, 2, 32)).view(-1, 8, 32)  # [n, 8, 32]
    high = _q6_k_high(words[:, 64:96].reshape(-1, 2, 16))  # [n, 8, 32]
    scales = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    scale = (_half(words, 104) * scales).unsqueeze(-1)  # [n, 16, 1]
    sub_blocks = out.view(-1, 16, 16)  # [n, 16, 16]
    sub_blocks.copy_((low | high).view(-1, 16, 16))
    sub_blocks.sub_(32.0).mul_(scale)


def block_fields(blocks: torch.Tensor, qtype: GGMLQuantizationType
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The codes and scale fields of blocks [n, type_size] (contiguous uint8) of a quantized
    type, as the file stores them: (codes [n, block_size] (uint8; Q8_0 int8), fields), the
    fields float16 (d, m, dmin) or integer (sc, m of the K types: uint8 [n, 8]; Q6_K's sc: int8
    [n, 16]), each [n, 1] or [n, sub-blocks]. Q5_*'s fifth bit and Q6_K's top two bits are
    in the codes."""
    words = blocks.view(torch.int16)

    def half(i: int) -> torch.Tensor:
        return words[:, i:i + 1].view(torch.float16)  # [n, 1]

    if qtype == Q.Q8_0:
        return blocks[:, 2:].view(torch.int8), {"d": half(0)}
    if qtype == Q.Q4_0:
        return _nibbles(words[:, 1:]).view(-1, 32), {"d": half(0)}
    if qtype == Q.Q4_1:
        return _nibbles(words[:, 2:]).view(-1, 32), {"d": half(0), "m": half(1)}
    if qtype == Q.Q5_0:
        return _five_bit(blocks, 2), {"d": half(0)}
    if qtype == Q.Q5_1:
        return _five_bit(blocks, 4), {"d": half(0), "m": half(1)}
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = _k_scale_bytes(blocks)
        if qtype == Q.Q4_K:
            codes = _k_low_nibbles(words[:, 8:72])
        else:
            codes = _k_low_nibbles(words[:, 24:88]) | _fifth_bits(blocks[:, 16:48]).transpose(1, 2)
        return codes.reshape(-1, 256), {"d": half(0), "dmin": half(1), "sc": sc, "m": mn}
    if qtype == Q.Q6_K:
        low = _nibbles(words[:, :64].reshape(-1, 2, 32)).view(-1, 8, 32)
        codes = (low | _q6_k_high(words[:, 64:96].reshape(-1, 2, 16))).reshape(-1, 256)
        return codes, {"d": half(104), "sc": blocks[:, 192:208].view(torch.int8)}
    raise ValueError(f"{GGMLQuantizationType(qtype).name} is not a quantized block type here")


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
    expected = _expected_bytes(qtype, tuple(shape), label)
    shape = tuple(int(dim) for dim in shape)
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
        decode(chunk, out[start : start + step])
    return out.view(shape)

