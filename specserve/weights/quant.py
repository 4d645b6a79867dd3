"""Weight-only quantized linear layers on our own kernels (`specserve/kernels/qmatmul.c`,
`NativeLinear`), layout v4 (`NativeWeights`).

Weights sit in blocks of 32 inputs; activations are quantized on the fly to int8 per
activation block (`ACT_BLOCK`: 64 inputs for the integer-scaled kinds, 32 for the float-scaled
ones), each block's dot product is integer, and the float steps come once per step (the finer
of the weights' step block and the activation block), so the rows of a verify pass cost
arithmetic, not memory traffic. The kinds (16 outputs side by side in a tile, but R8):

- K4, K6: 4- or 6-bit codes, each block an 8-bit scale multiplier sc and an 8-bit offset
  multiplier m of its super-block's float steps: w = dsup·sc·q + dmin·m (GGUF's Q4_K and
  Q5_K as they are; what int4 quantizes from float weights, `quantize_native`);
- S6: 6-bit codes, a signed 8-bit scale per 16 inputs: w = d·sc·(q − 32) (GGUF's Q6_K);
- B4, B6, B8: 4-, 6- or 8-bit codes, a float16 scale (and offset) per block: w = d·(q − zero)
  (+ m) (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);
- R8: 8-bit rows, w = dsup·sc·q, q in −127..127 (what int8 quantizes from float weights).

A GGUF file's quantized tensors are carried as their own blocks (`file_blocks.py`); `int4`
quantizes float weights (a Hugging Face directory, a float file) to K4, and `int8` to R8. A
projection may hold several parts of their own kinds (`Part`). The kernel sums integers
exactly per step and adds each step with one fma (the arithmetic the tests' reference repeats
to the bit).

The native kernels compute in float32, so the quantized model keeps its residual stream in
float32. Where they cannot be built or run (no C compiler, no AVX2), PyTorch's packed
kernels take over with bfloat16 activations: `aten._weight_int4pack_mm_for_cpu` (int4,
w = (q − 8)·scale + zero per block of 32, quantized from the float weights) and
`aten._weight_int8pack_mm` (int8 per output channel); their cost grows about linearly with
the rows.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from specserve import kernels
from specserve.kernels.decoder import (KIND_B4, KIND_B6, KIND_B8, KIND_BF16, KIND_F32, KIND_K4,
                                        KIND_K6, KIND_R8, KIND_S6, Proj, data_ptr)

# The `weights=` choices: "auto" follows the source (a quantized GGUF file stays quantized,
# int4-style; float sources load dense), "bf16"/"float32" load dense, "int8"/"int4" quantize;
# "int4-all" is int4 without the wider tensors (every projection and the head at 4 bits: a
# draft model's default, see `loader.load_model`).
FORMATS = ("auto", "bf16", "float32", "int8", "int4", "int4-all")
QUANTIZED_FORMATS = ("int8", "int4", "int4-all")
INT4_GROUP = 32


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [out, in] float → (q [out, in] int32 in 0..15, scales_and_zeros [in/group, out, 2])
    with w ≈ (q − 8)·scale + zero."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)  # [out, groups, group]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # [out, groups, 1]
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo) / scale).clamp_(0, 15)  # [out, groups, group]
    zero = lo + 8 * scale
    sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return q.reshape(out_f, in_f).to(torch.int32), sz


SUPER_BLOCKS = (256, 128, 64)  # the native kernel's super-block sizes, largest first


def super_block(in_features: int) -> int | None:
    """The largest native super-block size dividing `in_features` (None: none does)."""
    return next((sb for sb in SUPER_BLOCKS if in_features % sb == 0), None)


# The version of `NativeWeights`' layout: bump it whenever its fields, or how the kernels read
# them, change. The weight cache (`weight_cache.py`) keys its files by it, so weights repacked
# in an older layout are rebuilt, never read.
NATIVE_LAYOUT_VERSION = "4"  # 2: the 6-bit width (qh); 3: 4 and 6 bits with outputs in lanes;
# 4: the file's own blocks (S6 for Q6_K, B4/B6/B8 for Q4_0 ... Q8_0), code offsets (zero)
LANES = 16  # lanes kinds: outputs side by side in one tile
SC_MAX_LANES = 255  # K4, K6: the largest block scale multiplier (uint8)
MIN_MAX = 127  # K4, K6: the largest |offset multiplier| (int8)
# The kinds of quantized weights (`kernels/decoder.py`, `qmatmul.c`): K4, K6 (integer block
# scales and offsets: Q4_K, Q5_K, int4), S6 (signed integer scales per 16 inputs: Q6_K), B4,
# B6, B8 (a float16 scale, and offset, per block: Q4_0/Q4_1, Q5_0/Q5_1, Q8_0), R8 (rows: int8)
LANES_KINDS = (KIND_K4, KIND_K6, KIND_S6, KIND_B4, KIND_B6, KIND_B8)
FLOAT_BLOCK_KINDS = (KIND_B4, KIND_B6, KIND_B8)
CODE_BITS = {KIND_K4: 4, KIND_B4: 4, KIND_K6: 6, KIND_S6: 6, KIND_B6: 6, KIND_B8: 8,
             KIND_R8: 8}


@dataclass(frozen=True, slots=True)
class NativeWeights:
    """Weights in the native kernel's layout (see `specserve/kernels/qmatmul.c`).

    n = out_features, k = in_features, nb = k/32 blocks, nw = k/sb steps. Lanes kinds: T =
    ceil(n/16) tiles of 16 outputs, output o = tile o // 16, lane l = o % 16; the lanes past
    n are zero (every field). Weight o, i (block b, half h = i % 32 // 16, step s = i // sb):
    K4, K6: w = dsup[s]·sc[b]·q + dmin[s]·mins[b]; S6: w = dsup[s]·sc[b, h]·(q − zero);
    B4, B6, B8 (sb = 32): w = d[b]·(q − zero) (+ m[b]), d = dsup, m = dmin (float16).
    R8 (one output per row): w = dsup[s]·sc[b]·q.
    """

    kind: int  # one of LANES_KINDS or KIND_R8 (4, 6, 8: the v3 kinds K4, K6, R8)
    out_features: int  # n (lanes kinds: the tiles hold ceil(n/16)·16 outputs)
    sb: int  # the weights' step block: dsup, dmin per sb inputs (32 for the B kinds)
    # lanes kinds, 4 and 6 bits: [T, nb, 4, 64] uint8: chunk c, byte 4l + j: low nibble the
    # low 4 bits of q[16t + l, 32b + 4c + j], high nibble those of q[16t + l, 32b + 16 + 4c + j];
    # B8: [T, nb, 8, 64] uint8: chunk c, byte 4l + j: q[16t + l, 32b + 4c + j]; R8: [n, k] int8
    qs: torch.Tensor
    # K: [T, nb, 16] uint8 (0..255); S6: [T, nb, 2, 16] int8 (half h); B: None; R8: [n, nb] int16
    sc: torch.Tensor | None
    # K, S6: [T, nw, 16] float32; B: [T, nb, 16] float16 (d); R8: [n, nw] float32: the scale step
    dsup: torch.Tensor
    mins: torch.Tensor | None = None  # K: [T, nb, 16] int8 (−127..127) offset multiplier
    dmin: torch.Tensor | None = None  # K: [T, nw, 16] float32 offset step; B: [T, nb, 16] f16 (m)
    # 6-bit codes: [T, nb, 2, 64] uint8: chunk h, byte 4l + j, bits 2g, 2g + 1: q[16t + l,
    # 32b + 4(4h + g) + j] >> 4 (the top 2 bits of q)
    qh: torch.Tensor | None = None
    zero: int = 0  # the codes' offset (S6: 32; B: 8, 16, 128 or 0)

    @property
    def bits(self) -> int:
        """The codes' width: 4, 6 or 8."""
        return CODE_BITS[self.kind]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (INT4_GROUP if self.kind in LANES_KINDS else 1)

    def codes(self) -> torch.Tensor:
        """The integer codes q [n, k] int16 (4, 6, 8 bits: 0..15, 0..63, 0..255; R8: −127..127)."""
        if self.kind == KIND_R8:
            return self.qs.to(torch.int16)
        tiles, nb = self.qs.shape[:2]
        if self.bits == 8:
            qs = self.qs.to(torch.int16).reshape(tiles, nb, 8, LANES, 4)  # [T, nb, c, l, j]
            q = qs.permute(0, 1, 3, 2, 4).reshape(tiles, nb, LANES, INT4_GROUP)  # [T, nb, l, 32]
            return _untile(q.reshape(tiles, nb, LANES * INT4_GROUP), self.out_features)
        qs = self.qs.to(torch.int16).reshape(tiles, nb, 4, LANES, 4)  # [T, nb, c, l, j]
        halves = [(qs & 0x0F), (qs >> 4)]  # inputs 4c + j and 16 + 4c + j of the block
        q = torch.cat([h.permute(0, 1, 3, 2, 4).reshape(tiles, nb, LANES, 16) for h in halves],
                      dim=-1)  # [T, nb, l, 32]
        if self.bits == 6:
            qh = self.qh.to(torch.int16).reshape(tiles, nb, 2, LANES, 1, 4)  # [T, nb, h, l, 1, j]
            shifts = torch.arange(0, 8, 2, dtype=torch.int16)[:, None]  # [g, 1]: field g at 2g
            top = (qh >> shifts) & 3  # [T, nb, h, l, g, j]: input 4(4h + g) + j
            q = q | (top.permute(0, 1, 3, 2, 4, 5).reshape(q.shape) << 4)
        return _untile(q.reshape(tiles, nb, LANES * INT4_GROUP), self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weights [n, k] float32, each rounded once from its exact value where that is
        what the `gguf` package computes too: K: fl(fl(dsup·sc)·q + fl(dmin·m)); S6:
        fl(fl(dsup·sc)·(q − zero)); B: fl(d·(q − zero)) (+ m: fl(fl(d·q) + m))."""
        n, per = self.out_features, self.sb // INT4_GROUP
        q = self.codes().float().reshape(n, -1, INT4_GROUP)  # [n, nb, 32]
        if self.kind == KIND_R8:
            eff = self.dsup.repeat_interleave(per, dim=1) * self.sc.float()  # [n, nb]
            return (q * eff[..., None]).reshape(n, -1)
        if self.kind in FLOAT_BLOCK_KINDS:
            d = _untile(self.dsup, n).float()[..., None]  # [n, nb, 1]
            w = (q - self.zero) * d
            return (w if self.dmin is None else w + _untile(self.dmin, n).float()[..., None]
                    ).reshape(n, -1)
        dsup = _untile(self.dsup, n).repeat_interleave(per, dim=1)  # [n, nb]
        if self.kind == KIND_S6:
            sc = _untile(self.sc.reshape(self.sc.shape[0], -1, LANES), n).float()  # [n, 2 nb]
            eff = dsup.repeat_interleave(2, dim=1) * sc  # [n, 2 nb]: per half block
            return ((q.reshape(n, -1, 16) - self.zero) * eff[..., None]).reshape(n, -1)
        eff = dsup * _untile(self.sc, n).float()
        offset = _untile(self.dmin, n).repeat_interleave(per, dim=1) * _untile(self.mins, n).float()
        return (q * eff[..., None] + offset[..., None]).reshape(n, -1)

    def rows(self, first: int, count: int) -> "NativeWeights":
        """Outputs first .. first + count (lanes kinds: whole tiles, `first` a multiple of 16),
        views of these weights."""
        if self.kind == KIND_R8:
            pick = lambda a: a[first:first + count] if a is not None else None  # noqa: E731
        else:
            if first % LANES:
                raise ValueError(f"a lanes kind's rows start at a tile, got {first}")
            t0, t1 = first // LANES, -(-(first + count) // LANES)
            pick = lambda a: a[t0:t1] if a is not None else None  # noqa: E731
        return dataclasses.replace(self, out_features=count, qs=pick(self.qs), sc=pick(self.sc),
                                   dsup=pick(self.dsup), mins=pick(self.mins),
                                   dmin=pick(self.dmin), qh=pick(self.qh))


def _tile(t: torch.Tensor) -> torch.Tensor:
    """[n, x] → [T, x, 16]: output o at tile o // 16, lane o % 16, lanes past n zero."""
    n, x = t.shape
    tiles = -(-n // LANES)
    padded = torch.zeros((tiles * LANES, x), dtype=t.dtype)
    padded[:n] = t
    return padded.reshape(tiles, LANES, x).transpose(1, 2).contiguous()


def _untile(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `_tile`: [T, x, 16 · m] → [n, x · m] (m values per output and x)."""
    tiles, x = t.shape[:2]
    per = t.shape[2] // LANES
    return t.reshape(tiles, x, LANES, per).permute(0, 2, 1, 3).reshape(tiles * LANES, x * per)[:n]


def native_weights_to_tensors(w: NativeWeights) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `w` into its tensor fields and its plain fields (ints, None), for the weight
    cache; every field of the dataclass goes into one or the other."""
    tensors, plain = {}, {}
    for f in dataclasses.fields(w):
        value = getattr(w, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = value
        else:
            plain[f.name] = value
    return tensors, plain


def native_weights_from_tensors(tensors: dict[str, torch.Tensor], plain: dict) -> NativeWeights:
    """Inverse of `native_weights_to_tensors`."""
    return NativeWeights(**plain, **tensors)


def _pack_lanes(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes q [n, k] (0..15 or 0..63) → (qs [T, nb, 4, 64], qh [T, nb, 2, 64] or None)."""
    n, k = q.shape
    nb = k // INT4_GROUP
    tiled = _tile(q.to(torch.uint8)).reshape(-1, nb, INT4_GROUP, LANES)  # [T, nb, i, l]
    tiled = tiled.transpose(2, 3)  # [T, nb, l, i]
    tiles = tiled.shape[0]

    def chunks(part: torch.Tensor) -> torch.Tensor:  # [T, nb, l, 16]: inputs 4c + j → [T, nb, 4, 64]
        return part.reshape(tiles, nb, LANES, 4, 4).permute(0, 1, 3, 2, 4).reshape(tiles, nb, 4, 64)

    qs = chunks(tiled[..., :16] & 0x0F) | (chunks(tiled[..., 16:] & 0x0F) << 4)
    if bits != 6:
        return qs.contiguous(), None
    top = (tiled >> 4).reshape(tiles, nb, LANES, 2, 4, 4)  # [T, nb, l, h, g, j]: input 4(4h + g) + j
    packed = top[:, :, :, :, 0]
    for g in range(1, 4):
        packed = packed | (top[:, :, :, :, g] << (2 * g))  # [T, nb, l, h, j]
    qh = packed.permute(0, 1, 3, 2, 4).reshape(tiles, nb, 2, 64)
    return qs.contiguous(), qh.contiguous()


def _pack_bytes(q: torch.Tensor) -> torch.Tensor:
    """8-bit codes q [n, k] (uint8) → qs [T, nb, 8, 64]: chunk c, byte 4l + j = q[16t + l,
    32b + 4c + j]."""
    n, k = q.shape
    nb = k // INT4_GROUP
    tiled = _tile(q.to(torch.uint8)).reshape(-1, nb, 8, 4, LANES)  # [T, nb, c, j, l]
    return tiled.permute(0, 1, 2, 4, 3).reshape(-1, nb, 8, 64).contiguous()


def _safe(d: torch.Tensor) -> torch.Tensor:
    """`d` with its zeros replaced by 1 (a divisor whose quotients are masked out)."""
    return torch.where(d > 0, d, torch.ones_like(d))


def quantize_native(w: torch.Tensor, bits: int, sc_max: int) -> NativeWeights:
    """`w` [out, in] float → blocks of 32: 4- or 6-bit asymmetric (w ≈ dsup·sc·q + dmin·m,
    q in 0..15 or 0..63, sc ≤ `sc_max` ≤ 255, |m| ≤ 127) or 8-bit symmetric (w ≈ dsup·sc·q,
    |q| ≤ 127, sc ≤ `sc_max`).

    4 and 6 bits, per output row: each block's offset dmin·m is its minimum rounded down to
    the super-block's offset step (dmin = the largest |block minimum| / 127), so every weight
    sits at or above it; each block's scale multiplier sc is its own scale (range / top code)
    in units of dsup (= the super-block's largest scale / sc_max) rounded up (less a float
    tolerance of 1e-3), so no code clamps at the top: each weight is within half its block's
    applied step dsup·sc (blocks whose scale is below 1e-3·dsup get sc = 0: within
    top·1e-3·dsup), up to float32 rounding."""
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    if bits != 8 and not 1 <= sc_max <= SC_MAX_LANES:
        raise ValueError(f"sc_max must be 1..{SC_MAX_LANES} for {bits} bits, got {sc_max}")
    out_f, in_f = w.shape
    sb = super_block(in_f)
    if sb is None:
        raise ValueError(f"the native kernel needs in_features divisible by "
                         f"{SUPER_BLOCKS[-1]}, got {in_f}")
    per = sb // INT4_GROUP
    g = w.float().reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)  # [out, nb, 32]
    if bits == 8:
        return _quantize_rows_8(g, sb, sc_max)
    top = (1 << bits) - 1
    lo = g.amin(-1)  # [out, nb]
    dmin = lo.abs().reshape(out_f, -1, per).amax(-1) / MIN_MAX  # [out, ns]
    dmin_b = dmin.repeat_interleave(per, dim=1)  # [out, nb]
    mins = torch.where(dmin_b > 0, torch.floor(lo / _safe(dmin_b)), 0).clamp_(-MIN_MAX, MIN_MAX)
    r = g - (dmin_b * mins)[..., None]  # [out, nb, 32], ≥ 0 up to float rounding
    scale = r.amax(-1).clamp_min(0) / top  # [out, nb]
    dsup = scale.reshape(out_f, -1, per).amax(-1) / sc_max  # [out, ns]
    step = dsup.repeat_interleave(per, dim=1)  # [out, nb]
    sc = torch.where(step > 0, torch.ceil(scale / _safe(step) - 1e-3), 0).clamp_(0, sc_max)
    eff = (step * sc)[..., None]  # [out, nb, 1] the scale the kernel applies
    q = torch.where(eff > 0, torch.round(r / _safe(eff)), 0).clamp_(0, top)
    qs, qh = _pack_lanes(q.reshape(out_f, in_f), bits)
    return NativeWeights(bits, out_f, sb, qs, _tile(sc.to(torch.uint8)), _tile(dsup),
                         _tile(mins.to(torch.int8)), _tile(dmin), qh)


def _quantize_rows_8(g: torch.Tensor, sb: int, sc_max: int) -> NativeWeights:
    """8 bits, row layout (v2): g [out, nb, 32] → w ≈ dsup·sc·q, the block scale rounded to
    the nearest multiple of the super-block's step (largest block scale / `sc_max`)."""
    out_f, nb, _ = g.shape
    per = sb // INT4_GROUP
    scale = g.abs().amax(-1) / 127  # [out, nb]
    dsup = scale.reshape(out_f, -1, per).amax(-1) / sc_max  # [out, ns]
    step = dsup.repeat_interleave(per, dim=1)  # [out, nb]
    sc = torch.where(step > 0, torch.round(scale / step.clamp_min(1e-30)), 0).clamp_(0, sc_max)
    eff = (step * sc)[..., None]  # [out, nb, 1]
    q = torch.where(eff > 0, torch.round(g / eff.clamp_min(1e-30)), 0).clamp_(-127, 127)
    return NativeWeights(8, out_f, sb, q.to(torch.int8).reshape(out_f, -1).contiguous(),
                         sc.to(torch.int16).contiguous(), dsup.contiguous())


# Activations are quantized to int8 per ACT_BLOCK inputs (per their largest block of 256, 128,
# 64 or 32 not above it that divides a projection's width; int8 rows: per their super-block).
# Chosen by fidelity and speed measured on the default pair (docs/fidelity.md).
ACT_BLOCK = 64
ACT_BLOCKS = (256, 128, 64, 32)


def act_block(in_features: int, preferred: int = ACT_BLOCK) -> int:
    """The activation block of a projection `in_features` wide (a multiple of 32)."""
    return next(b for b in ACT_BLOCKS if b <= preferred and in_features % b == 0)


def kind_act_block(kind: int, in_features: int, preferred: int | None = None) -> int:
    """The activation block a part of `kind` runs with: `preferred`, else ACT_BLOCK, but 32 for
    the float-scaled blocks (B kinds: a float step per block of 32 anyway, and llama.cpp's
    Q8_0 activations for them) and the step block for the 8-bit rows."""
    if preferred is None:
        preferred = 32 if kind in FLOAT_BLOCK_KINDS else ACT_BLOCK
    return act_block(in_features, preferred)


# A part of a projection: quantized weights, or dense float32 / bfloat16 weights [n, k]
Part = NativeWeights | torch.Tensor


def part_width(part: Part) -> tuple[int, int]:
    """(outputs, inputs) of a part."""
    if isinstance(part, torch.Tensor):
        return part.shape[0], part.shape[1]
    return part.out_features, part.in_features


class NativeLinear:
    """A projection on the native kernels: one or more parts (`Part`), each its own kind (a
    fused q/k/v whose value rows the file stores otherwise than its query and key rows), side
    by side in the output; computes in float32 and returns the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
                 isa: str | None = None, act_block: int | None = None) -> None:
        """`weight` [out, in] float quantized to `bits` (4, 6: K4, K6; 8: R8; `quantize_native`)."""
        lib = kernels.qmatmul(isa)  # `isa` None: the widest this CPU runs (kernels.isa())
        if lib is None:
            raise RuntimeError("the native quantized kernels are not available on this machine")
        if bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
        self._setup(lib, isa, (quantize_native(weight, bits, lib.q_sc_max(bits)),), bias,
                    act_block)

    @classmethod
    def from_weights(cls, w: NativeWeights, bias: torch.Tensor | None,
                     isa: str | None = None, act_block: int | None = None) -> "NativeLinear":
        """A layer over weights already in the kernel's layout (no quantization)."""
        return cls.from_parts((w,), bias, isa, act_block)

    @classmethod
    def from_parts(cls, parts: tuple[Part, ...], bias: torch.Tensor | None,
                   isa: str | None = None, act_block: int | None = None) -> "NativeLinear":
        """A layer over `parts` (their outputs side by side, in order) and `bias` [Σ outputs];
        `act_block` None: each part's kind's (`kind_act_block`)."""
        lib = kernels.qmatmul(isa)
        if lib is None:
            raise RuntimeError("the native quantized kernels are not available on this machine")
        layer = cls.__new__(cls)
        layer._setup(lib, isa, tuple(parts), bias, act_block)
        return layer

    def _setup(self, lib, isa: str | None, parts: tuple[Part, ...], bias: torch.Tensor | None,
               act_block: int | None) -> None:
        widths = {part_width(p)[1] for p in parts}
        if not parts or len(widths) != 1:
            raise ValueError(f"a projection's parts must share their input width, got {widths}")
        self._lib, self._isa, self.parts, self.act_block = lib, isa, parts, act_block
        self.in_features = widths.pop()
        self.out_features = sum(part_width(p)[0] for p in parts)
        self.bias = bias.float().contiguous() if bias is not None else None
        self._chain = self._build_chain(0)

    @property
    def w(self) -> NativeWeights:
        """The weights of a projection of one quantized part."""
        if len(self.parts) != 1 or not isinstance(self.parts[0], NativeWeights):
            raise ValueError("this projection is not one quantized part (see .parts)")
        return self.parts[0]

    def with_act_block(self, act_block: int) -> "NativeLinear":
        """The same weights with activations quantized per `act_block` inputs (benchmarks)."""
        return NativeLinear.from_parts(self.parts, self.bias, self._isa, act_block)

    def _build_chain(self, path: int) -> list[Proj]:
        """The parts as `proj_t`s, chained in order (the first carries the bias): built once,
        the tensors never move (`self.parts` keeps them)."""
        chain = [self._proj(p, path) for p in self.parts]
        for a, b in zip(chain, chain[1:]):
            a.next = ctypes.addressof(b)
        chain[0].bias = data_ptr(self.bias)
        return chain

    def _proj(self, p: Part, path: int) -> Proj:
        k = self.in_features
        if isinstance(p, torch.Tensor):
            kind = KIND_BF16 if p.dtype == torch.bfloat16 else KIND_F32
            return Proj(kind, k, p.shape[0], 0, p.data_ptr(), path=path)
        ab = p.sb if p.kind == KIND_R8 else kind_act_block(p.kind, k, self.act_block)
        return Proj(p.kind, k, p.out_features, p.sb, p.qs.data_ptr(), data_ptr(p.qh),
                    data_ptr(p.sc), p.dsup.data_ptr(), data_ptr(p.mins), data_ptr(p.dmin),
                    None, ab, p.zero, path)

    def native_proj(self) -> Proj:
        """This projection as the fused decoder pass runs it (`kernels/decoder.py`)."""
        head = self._chain[0]
        head.keep = self._chain  # the parts after it live as long as it does
        return head

    def __call__(self, x: torch.Tensor, path: int = 0) -> torch.Tensor:
        """`path` (tests, benchmarks): 0 lets the kernel choose, 1 forces its decode loop
        (outputs one by one over all rows), 2 its prefill tiles; all give the same bits."""
        return self._apply(x, None, path)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`self(x)` written into `out` [rows, out_features] float32 (the native pass reuses
        one buffer for every layer: a prefill's fresh 30+ MB output would be mapped and
        faulted in page by page, layer after layer, costing a third of the matmul)."""
        return self._apply(x, out)

    def _apply(self, x: torch.Tensor, out: torch.Tensor | None, path: int = 0) -> torch.Tensor:
        plain = (x.dim() == 2 and x.shape[1] == self.in_features and x.dtype == torch.float32
                 and x.is_contiguous())  # the native pass's activations: used as they are
        flat = x if plain else x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        rows = flat.shape[0]  # flat: [rows, in]
        shape = (rows, self.out_features)
        if out is not None and (not plain or out.shape != shape or out.dtype != torch.float32
                                or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous float32 {shape} for a plain input")
        y = torch.empty(shape, dtype=torch.float32) if out is None else out
        chain = self._chain if path == 0 else self._build_chain(path)
        rc = self._lib.proj_run(ctypes.byref(chain[0]), flat.data_ptr(), rows, y.data_ptr())
        if rc != 0:
            raise RuntimeError(f"proj_run failed ({'out of memory' if rc == -1 else 'bad arguments'})")
        return y if plain else y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int4Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16, group: int = INT4_GROUP) -> None:
        self.out_features, self.in_features = weight.shape
        if self.in_features % group:
            raise ValueError(f"int4 needs in_features divisible by {group}, got {self.in_features}")
        q, sz = quantize_int4(weight, group)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = sz.to(dtype)
        self.bias = bias.to(dtype) if bias is not None else None
        self.group, self.dtype = group, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)  # [rows, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        w = weight.float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
        self.weight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        self.scales = scale.to(dtype)
        self.bias = bias.to(dtype) if bias is not None else None
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)  # [rows, in]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


# The checkpoint tensors behind each projection (Hugging Face names, without ".weight").
_SOURCES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",)}
# int4 keeps wider what the file stores with more bits per weight: Q4_0/Q4_1/Q4_K (4.5-5.0
# bits) become 4-bit; Q5_0/Q5_1/Q5_K/Q6_K (5.5-6.56 bits; llama.cpp's Q4_K_M files give the
# output head and half the value and down projections Q6_K) 6-bit; above SIX_BIT_SOURCE_MAX
# (Q8_0, F16, BF16, F32) 8-bit.
FOUR_BIT_SOURCE_MAX = 5.0
SIX_BIT_SOURCE_MAX = 7.0


def projection_width(fmt: str, sources: list[str], source_bits: dict[str, float]) -> int:
    """Bits a projection gets under `fmt` ("int8" | "int4" | "int4-all"): int8 all 8, int4-all
    all 4; int4 follows the widest of its sources (fused q/k/v: all three) in the file, 4 up
    to `FOUR_BIT_SOURCE_MAX` bits per weight, 6 up to `SIX_BIT_SOURCE_MAX`, 8 above."""
    if fmt == "int8":
        return 8
    if fmt == "int4-all":
        return 4
    widest = max((source_bits.get(n, 0.0) for n in sources), default=0.0)
    return 4 if widest <= FOUR_BIT_SOURCE_MAX else 6 if widest <= SIX_BIT_SOURCE_MAX else 8


def quantize_linear(lin, width: int, native: bool):
    """One `Linear` as a 4-, 6- or 8-bit layer: the native kernel's where it runs and the input
    width suits it, else PyTorch's packed kernels (6 bits there: int8)."""
    if native and super_block(lin.weight.shape[1]) is not None:
        return NativeLinear(lin.weight, lin.bias, width)
    return (Int4Linear if width == 4 else Int8Linear)(lin.weight, lin.bias)


def layer_projections(index: int) -> dict[str, list[str]]:
    """Attribute of decoder layer `index` → the checkpoint tensors (Hugging Face names) behind it."""
    return {attr: [f"model.layers.{index}.{src}.weight" for src in sources]
            for attr, sources in _SOURCES.items()}


def head_source(source_bits: dict[str, float]) -> str:
    """The checkpoint tensor behind the output head (the embedding when tied)."""
    return "lm_head.weight" if "lm_head.weight" in source_bits else "model.embed_tokens.weight"


def quantize_layer(layer, index: int, fmt: str, source_bits: dict[str, float],
                   native: bool) -> None:
    """Replace every projection of decoder layer `index` by `fmt` (one of QUANTIZED_FORMATS)."""
    for attr, names in layer_projections(index).items():
        width = projection_width(fmt, names, source_bits)
        setattr(layer, attr, quantize_linear(getattr(layer, attr), width, native))


def quantize_linears(model, fmt: str, source_bits: dict[str, float] | None = None) -> None:
    """Replace every projection of `model` (a `Transformer`) and its output head by `fmt`
    ("bf16" and "float32" leave it dense).

    `source_bits` (Hugging Face name → bits per weight in the file) lets int4 keep tensors the
    file stores with more bits at 6 or 8 (`projection_width`); without it (a float checkpoint)
    all become int4."""
    if fmt not in FORMATS or fmt == "auto":
        raise ValueError(f"weights must be one of {FORMATS[1:]} here, got {fmt!r}")
    if fmt not in QUANTIZED_FORMATS:
        return
    native = kernels.qmatmul() is not None
    if not native and model.dtype != torch.bfloat16:
        raise ValueError(f"weights={fmt!r} runs with bfloat16 activations here (no native "
                         f"kernel); load with dtype='bfloat16'")
    bits = source_bits or {}
    for i, layer in enumerate(model.layers):
        quantize_layer(layer, i, fmt, bits, native)
    head = head_source(bits)
    model.lm_head = quantize_linear(model.lm_head, projection_width(fmt, [head], bits), native)
    if native:  # the native kernels take float32: keep the residual stream in float32
        model.act_dtype = torch.float32
