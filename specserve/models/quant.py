"""Weight-only quantized linear layers on PyTorch's packed CPU kernels.

- `int4`: asymmetric 4-bit, groups of 32 input weights share a scale and a zero point (the
  granularity of GGUF's Q4_K sub-blocks), run by `aten._weight_int4pack_mm_for_cpu`, which
  dequantizes as w = (q − 8)·scale + zero with bfloat16 activations.
- `int8`: symmetric 8-bit per output channel, run by `aten._weight_int8pack_mm`.

Both kernels want bfloat16 activations (their float32 paths are far slower on AVX2), so the
quantized formats run the rest of the model in bfloat16.
"""

from __future__ import annotations

import torch

FORMATS = ("bf16", "int8", "int4")
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


def quantize_linears(model, fmt: str) -> None:
    """Replace every projection of `model` (a `Transformer`) and its output head by `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"weights must be one of {FORMATS}, got {fmt!r}")
    if fmt == "bf16":
        return
    if model.dtype != torch.bfloat16:
        raise ValueError(f"weights={fmt!r} runs with bfloat16 activations; load with dtype='bfloat16'")
    make = Int4Linear if fmt == "int4" else Int8Linear
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, make(lin.weight, lin.bias))
    model.lm_head = make(model.lm_head.weight, model.lm_head.bias)
