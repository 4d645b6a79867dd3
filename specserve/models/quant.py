"""Weight-only quantized linear layers.

Both formats keep weights in blocks of 32 inputs (the granularity of GGUF's Q4_K, Q6_K and
Q8_0 sub-blocks), each block with its own scale, and run on our own AVX2 kernel
(`specserve/kernels/qmatmul.c`, `NativeLinear`): activations are quantized on the fly to int8
per super-block, each block's dot product is integer (pmaddubsw), and one weight block, once
unpacked, serves four activation rows, so the rows of a verify pass cost arithmetic, not
memory traffic.

- `int4`: asymmetric 4-bit, w = scale·q + min, q in 0..15 (a Q4_K or Q4_1 tensor requantizes
  almost exactly). What a GGUF file stores with more bits keeps more: Q5_x and Q6_K (in
  llama.cpp's Q4_K_M files the output head and half the value and down projections) at 6 bits,
  asymmetric like 4 (q in 0..63), Q8_0 and float tensors at 8 bits.
- `int8`: symmetric 8-bit per block, w = scale·q, q in −127..127.

The native kernels compute in float32, so the quantized model keeps its residual stream in
float32. Where they cannot be built or run (no C compiler, no AVX2), PyTorch's packed
kernels take over with bfloat16 activations: `aten._weight_int4pack_mm_for_cpu` (int4,
same blocks, w = (q − 8)·scale + zero) and `aten._weight_int8pack_mm` (int8 per output
channel); their cost grows about linearly with the rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specserve import kernels

# The `weights=` choices: "auto" follows the source (a quantized GGUF file stays quantized,
# int4-style; float sources load dense), "bf16"/"float32" load dense, "int8"/"int4" quantize.
FORMATS = ("auto", "bf16", "float32", "int8", "int4")
QUANTIZED_FORMATS = ("int8", "int4")
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


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Float reference of what the int4 kernel computes with (for tests)."""
    out_f, in_f = q.shape
    scale = sz[..., 0].t().repeat_interleave(group, dim=1)  # [out, in]
    zero = sz[..., 1].t().repeat_interleave(group, dim=1)  # [out, in]
    return (q.float() - 8) * scale.float() + zero.float()


SUPER_BLOCKS = (256, 128, 64)  # the native kernel's super-block sizes, largest first


def super_block(in_features: int) -> int | None:
    """The largest native super-block size dividing `in_features` (None: none does)."""
    return next((sb for sb in SUPER_BLOCKS if in_features % sb == 0), None)


# The version of `NativeWeights`' layout: bump it whenever its fields, or how the kernels read
# them, change. The weight cache (`weight_cache.py`) keys its files by it, so weights repacked
# in an older layout are rebuilt, never read.
NATIVE_LAYOUT_VERSION = "2"  # 2: the 6-bit width (qh)


@dataclass(frozen=True, slots=True)
class NativeWeights:
    """Weights in the native kernel's layout (see `specserve/kernels/qmatmul.c`)."""

    bits: int  # 4 | 6 | 8
    # 4 and 6: [out, in/64, 32] uint8, the low 4 bits of q: block 2p in the low nibbles, 2p + 1
    # in the high ones; 8: [out, in] int8
    qs: torch.Tensor
    sc: torch.Tensor  # [out, in/32] int16: block scale = dsup · sc
    dsup: torch.Tensor  # [out, in/sb] float32: scale step of each super-block
    mins: torch.Tensor | None  # 4 and 6 bits: [out, in/32] float16 block minimum
    sb: int  # super-block size
    # 6 bits: [out, in/64, 16] uint8, the top 2 bits of q: byte j of a block pair holds those of
    # its weights j + 16g (g = 0..3; weights 0..31 block 2p, 32..63 block 2p + 1) at bits 2g, 2g + 1
    qh: torch.Tensor | None = None

    def codes(self) -> torch.Tensor:
        """The integer weights q [out, in] (4 and 6 bits: 0..15 or 0..63; 8: −127..127)."""
        out_f = self.qs.shape[0]
        if self.bits == 8:
            return self.qs.to(torch.int16)
        q = torch.stack([self.qs & 0x0F, self.qs >> 4], dim=2)  # [out, pairs, 2, 32]
        q = q.to(torch.int16)
        if self.bits == 6:
            shifts = torch.arange(0, 8, 2, dtype=torch.int16)  # [4] field g at bits 2g
            high = (self.qh.to(torch.int16)[:, :, None, :] >> shifts[:, None]) & 3
            # high: [out, pairs, 4, 16], field g of byte j: weight 16g + j of the pair
            q = q | (high.reshape(q.shape) << 4)
        return q.reshape(out_f, -1)

    def dequantize(self) -> torch.Tensor:
        """Float reference of the quantized weights [out, in] (for tests)."""
        out_f = self.qs.shape[0]
        q = self.codes().float().reshape(out_f, -1, INT4_GROUP)  # [out, blocks, 32]
        scale = self.dsup.repeat_interleave(self.sb // INT4_GROUP, dim=1) * self.sc.float()
        w = q * scale[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        return w.reshape(out_f, -1)


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


def quantize_native(w: torch.Tensor, bits: int, sc_max: int) -> NativeWeights:
    """`w` [out, in] float → blocks of 32, 4- or 6-bit asymmetric (w ≈ scale·q + min, q in
    0..15 or 0..63) or 8-bit symmetric (w ≈ scale·q, |q| ≤ 127), each block's scale an integer
    multiple (≤ `sc_max`) of its super-block's step."""
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    out_f, in_f = w.shape
    sb = super_block(in_f)
    if sb is None:
        raise ValueError(f"the native kernel needs in_features divisible by "
                         f"{SUPER_BLOCKS[-1]}, got {in_f}")
    g = w.float().reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)  # [out, blocks, 32]
    if bits in (4, 6):
        mins = g.amin(-1).to(torch.float16)  # [out, blocks]
        g = g - mins.float()[..., None]
        top = (1 << bits) - 1
        scale = g.amax(-1).clamp_min(0) / top
    else:
        mins, scale, top = None, g.abs().amax(-1) / 127, 127
    per = sb // INT4_GROUP
    dsup = scale.reshape(out_f, -1, per).amax(-1) / sc_max  # [out, in/sb]
    step = dsup.repeat_interleave(per, dim=1)  # [out, blocks]
    ratio = scale / step.clamp_min(1e-30)
    # 6 bits round the integer scale up (less a float tolerance), so that the applied scale is
    # never below the block's and no code clamps: |error| ≤ (scale + dsup)/2 per weight, where
    # rounding to nearest would allow 63·dsup/2 at the top of a small block beside a large
    # one. (4 and 8 bits keep rounding to nearest: the same bits as before.)
    rounded = torch.ceil(ratio - 1e-3) if bits == 6 else torch.round(ratio)
    sc = torch.where(step > 0, rounded, 0).clamp_(0, sc_max)
    eff = (step * sc)[..., None]  # [out, blocks, 1] the scale the kernel applies
    q = torch.where(eff > 0, torch.round(g / eff.clamp_min(1e-30)), 0)
    q = q.clamp_(0 if bits != 8 else -top, top)
    qh = None
    if bits == 8:
        qs = q.to(torch.int8).reshape(out_f, in_f)
    else:
        q = q.to(torch.uint8).reshape(out_f, in_f // (2 * INT4_GROUP), 2, INT4_GROUP)
        qs = (q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)  # [out, pairs, 32]
        if bits == 6:
            high = (q >> 4).reshape(out_f, -1, 4, 16)  # [out, pairs, g, j]: weight 16g + j
            qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
                  | (high[:, :, 3] << 6)).contiguous()  # [out, pairs, 16]
    return NativeWeights(bits, qs.contiguous(), sc.to(torch.int16).contiguous(),
                         dsup.contiguous(), None if mins is None else mins.contiguous(), sb, qh)


class NativeLinear:
    """4-, 6- or 8-bit weights on the native kernel (see module doc); computes in float32 and
    returns the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
                 isa: str | None = None) -> None:
        self._lib = kernels.qmatmul(isa)  # `isa` None: the widest this CPU runs (kernels.isa())
        if self._lib is None:
            raise RuntimeError("the native quantized kernels are not available on this machine")
        if bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
        self.out_features, self.in_features = weight.shape
        self.w = quantize_native(weight, bits, self._lib.q_sc_max(bits))
        self.bias = bias.float() if bias is not None else None

    @classmethod
    def from_weights(cls, w: NativeWeights, bias: torch.Tensor | None,
                     isa: str | None = None) -> "NativeLinear":
        """A layer over weights already in the kernel's layout (the weight cache's path: no
        quantization). `w` and `bias` must be what a layer built by `__init__` holds."""
        layer = cls.__new__(cls)
        layer._lib = kernels.qmatmul(isa)
        if layer._lib is None:
            raise RuntimeError("the native quantized kernels are not available on this machine")
        layer.out_features, layer.in_features = w.qs.shape[0], w.sc.shape[1] * INT4_GROUP
        layer.w = w
        layer.bias = bias.float() if bias is not None else None
        return layer

    def __call__(self, x: torch.Tensor, path: int = 0) -> torch.Tensor:
        """`path` (tests, benchmarks): 0 lets the kernel choose, 1 forces its decode loop
        (outputs one by one over all rows), 2 its prefill tiles; all give the same bits."""
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()  # [rows, in]
        y = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        w = self.w
        mins = w.mins.data_ptr() if w.mins is not None else None
        qh = w.qh.data_ptr() if w.qh is not None else None
        rc = self._lib.q_matmul(w.bits, flat.data_ptr(), flat.shape[0], self.in_features, w.sb,
                                w.qs.data_ptr(), qh, w.sc.data_ptr(), w.dsup.data_ptr(), mins,
                                self.out_features, y.data_ptr(), path)
        if rc != 0:
            raise RuntimeError(f"q_matmul failed ({'out of memory' if rc == -1 else 'bad arguments'})")
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


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
    """Bits a projection gets under `fmt` ("int8" | "int4"): int8 all 8; int4 follows the
    widest of its sources (fused q/k/v: all three) in the file, 4 up to `FOUR_BIT_SOURCE_MAX`
    bits per weight, 6 up to `SIX_BIT_SOURCE_MAX`, 8 above."""
    if fmt == "int8":
        return 8
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
    """Replace every projection of decoder layer `index` by `fmt` ("int8" | "int4")."""
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
