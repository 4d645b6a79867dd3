"""One decoder layer's weights, and the dense projection and RMSNorm they are applied with.

`Layer` gathers a checkpoint's tensors (Hugging Face names) for one layer: the fused q/k/v and
gate/up projections, the output and down projections, and its norms: the two of `llama` and
`qwen2`, the per-head q/k norms of `qwen3` and `gemma3`, and `gemma3`'s norms after attention
and after the MLP (its "pre-feedforward" norm is the MLP's input norm here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.kernels.decoder import KIND_BF16, KIND_F32, Proj, data_ptr
from specserve.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# From this many rows on, a bfloat16 matmul is computed in float32: CPUs without native
# bfloat16 (AVX2) run bf16 GEMMs ~10x slower than converting the weight and calling sgemm.
FLOAT32_GEMM_ROWS = 32


class Linear:
    """A weight (and optional bias) applied as `x @ W.T + b`; quantized formats replace it.

    Float32 activations with float32 or bfloat16 weights run on the native float kernel
    (`f_matmul` in `specserve/kernels/qmatmul.c`) where it is available: each row's result is
    then the same bits whatever the other rows of the pass (batch invariance, as the quantized
    kernels). Elsewhere, and for bfloat16 activations, PyTorch's matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = self._native_lib(x)
        if lib is not None:
            return self._native(lib, x)
        w = self.weight
        if w.dtype == torch.bfloat16 and x.numel() >= FLOAT32_GEMM_ROWS * x.shape[-1]:
            b = self.bias.float() if self.bias is not None else None
            return F.linear(x.float(), w.float(), b).to(x.dtype)
        return F.linear(x, w, self.bias)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`self(x)` written into `out` [rows, out] (the native pass reuses one buffer for
        every layer, as with `NativeLinear.into`); returns `out`."""
        lib = self._native_lib(x)
        if lib is None:
            return out.copy_(self(x).reshape(out.shape))
        if out.shape != (x.numel() // x.shape[-1], self.weight.shape[0]) \
                or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("out must be a contiguous float32 [rows, out_features]")
        self._native(lib, x, out)
        return out

    def native_proj(self) -> Proj | None:
        """This projection as the fused decoder pass runs it (`kernels/decoder.py`): float32 or
        bfloat16 weights on the float kernel; None for other dtypes."""
        w = self.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or kernels.qmatmul() is None:
            return None
        weight = w.contiguous()
        bias = None if self.bias is None else self.bias.float().contiguous()
        kind = KIND_BF16 if w.dtype == torch.bfloat16 else KIND_F32
        proj = Proj(kind, w.shape[1], w.shape[0], 0, weight.data_ptr(), None, None, None, None,
                    None, data_ptr(bias))
        proj.keep = (weight, bias)  # what it points to lives as long as it does
        return proj

    def _native_lib(self, x: torch.Tensor):
        """The float kernel's library where it serves `x` (float32 activations, float32 or
        bfloat16 weights), else None."""
        if x.dtype == torch.float32 and self.weight.dtype in (torch.float32, torch.bfloat16):
            return kernels.qmatmul()
        return None

    def _native(self, lib, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight.contiguous()  # [out, in]
        out_f, in_f = w.shape
        flat = x.reshape(-1, in_f).contiguous()  # [rows, in]
        y = torch.empty((flat.shape[0], out_f), dtype=torch.float32) if out is None else out
        bias = self.bias.float().contiguous() if self.bias is not None else None
        rc = lib.f_matmul(flat.data_ptr(), flat.shape[0], in_f, w.data_ptr(),
                          int(w.dtype == torch.bfloat16),
                          bias.data_ptr() if bias is not None else None, out_f, y.data_ptr())
        if rc != 0:
            raise RuntimeError("f_matmul: bad arguments")
        return y.reshape(*x.shape[:-1], out_f)


class Layer:
    """Layer `prefix` of a checkpoint; optional norms are None where the architecture has none."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.{name}"]

        qkv = torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"),
                         get("self_attn.v_proj.weight")])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"),
                              get("self_attn.v_proj.bias")])
        self.qkv = Linear(qkv, bias)
        self.o = Linear(get("self_attn.o_proj.weight"))
        self.gate_up = Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
        self.down = Linear(get("mlp.down_proj.weight"))
        self.attn_norm = get("input_layernorm.weight")  # [hidden]
        self.q_norm = get("self_attn.q_norm.weight") if cfg.qk_norm else None  # [hd]
        self.k_norm = get("self_attn.k_norm.weight") if cfg.qk_norm else None  # [hd]
        if cfg.sandwich_norms:
            self.attn_post_norm = get("post_attention_layernorm.weight")  # [hidden]
            self.mlp_norm = get("pre_feedforward_layernorm.weight")  # [hidden]
            self.mlp_post_norm = get("post_feedforward_layernorm.weight")  # [hidden]
        else:
            self.attn_post_norm = self.mlp_post_norm = None
            self.mlp_norm = get("post_attention_layernorm.weight")  # [hidden]

    def norms(self) -> list[torch.Tensor]:
        """Every norm weight of the layer."""
        return [n for n in (self.attn_norm, self.q_norm, self.k_norm, self.attn_post_norm,
                            self.mlp_norm, self.mlp_post_norm) if n is not None]


def layer_tensor_names(cfg: ModelConfig) -> list[str]:
    """The tensors (Hugging Face names, after `model.layers.N.`) one layer of `cfg` reads."""
    names = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
        f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + [
        "input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.attention_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.sandwich_norms:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names
