"""The full and sliding attention layers of the hybrid decoders, over their own paged KV pools.

One class serves both families; `ModelConfig` says what each layer has:
- Qwen3.5: q_proj gives each head's query and an output gate side by side (`[q_h | gate_h]`),
  the output is multiplied by sigmoid(gate) before o_proj; per-head q/k RMSNorms; the rotary
  embedding turns only the leading `rotary_dim` dims of a head.
- Gemma 4: per-head q/k RMSNorms and a weightless RMSNorm of each value head, query scale 1;
  global layers with their own head size and KV heads (`GlobalAttention`), keys reused as
  values where `k_eq_v`, "proportional" rope; sliding layers through a window; a layer among
  the last `kv_shared_layers` writes nothing and attends to the pool of the last earlier layer
  of its kind (`kv_source`).
"""

from __future__ import annotations

import torch

from specserve.models import rope
from specserve.models.attention import ragged_attention
from specserve.models.config import ModelConfig
from specserve.models.layer import Linear, rms_norm, rotate_half

ATTN_DTYPE = torch.float32


def kv_sources(cfg: ModelConfig) -> list[int | None]:
    """Per layer, the layer whose KV pool it attends to (itself, or for Gemma 4's shared layers
    the last earlier non-shared layer of its kind); None for linear-attention layers."""
    first_shared = cfg.num_layers - cfg.kv_shared_layers
    out: list[int | None] = []
    for i in range(cfg.num_layers):
        if i in cfg.linear_layers:
            out.append(None)
        elif i < first_shared:
            out.append(i)
        else:
            kind = i in cfg.sliding_layers
            earlier = [j for j in range(first_shared) if (j in cfg.sliding_layers) == kind]
            if not earlier:
                raise ValueError(f"layer {i} shares keys and values, but no earlier layer of "
                                 f"its kind computes them")
            out.append(earlier[-1])
    return out


def layer_geometry(cfg: ModelConfig, i: int) -> tuple[int, int]:
    """(KV heads, head_dim) of attention layer `i`."""
    ga = cfg.global_attention
    if ga is not None and i not in cfg.sliding_layers:
        return ga.num_kv_heads, ga.head_dim
    return cfg.num_kv_heads, cfg.head_dim


def layer_inv_freq(cfg: ModelConfig, i: int) -> torch.Tensor:
    """The float32 inverse frequencies `[rotated dims / 2]` of attention layer `i`."""
    ga = cfg.global_attention
    if i in cfg.sliding_layers:
        return rope.inv_freq(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta)
    if ga is not None:  # proportional: base^(-2j / head_dim) for the first rope_angles pairs
        base = rope.inv_freq(ga.head_dim, ga.rope_theta)[:ga.rope_angles]
        pad = torch.zeros(ga.head_dim // 2 - ga.rope_angles)
        return torch.cat([base, pad]) / ga.rope_factor
    return rope.inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of the leading cos.shape[-1] dims of `x` `[rows, heads,
    hd]` (cos, sin `[rows, 1, rotated]`); the other dims pass unchanged."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, rest = x[..., :width], x[..., width:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, rest], dim=-1)


class HybridAttention:
    """Attention layer `index` of a `qwen35` or `gemma4` checkpoint (names under `prefix`)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, index: int,
                 kv_source: int) -> None:
        def get(name: str) -> torch.Tensor:
            return w[f"{prefix}.self_attn.{name}"]

        self.heads = cfg.num_heads
        self.kv_heads, self.head_dim = layer_geometry(cfg, index)
        self.window = cfg.sliding_window if index in cfg.sliding_layers else None
        self.scale, self.eps, self.gated = cfg.attn_scale, cfg.rms_norm_eps, cfg.attn_output_gate
        self.value_norm = cfg.value_norm
        self.kv_source = kv_source  # the layer whose pool this one attends to
        self.writes = kv_source == index
        self.q = Linear(get("q_proj.weight"))
        self.o = Linear(get("o_proj.weight"))
        self.q_norm = get("q_norm.weight") if cfg.qk_norm else None  # [hd]
        self.kv = self.k_norm = None
        self.k_eq_v = cfg.global_attention is not None and cfg.global_attention.k_eq_v \
            and index not in cfg.sliding_layers
        if self.writes:
            kv = [get("k_proj.weight")] + ([] if self.k_eq_v else [get("v_proj.weight")])
            self.kv = Linear(torch.cat(kv))
            self.k_norm = get("k_norm.weight") if cfg.qk_norm else None  # [hd]

    def __call__(self, h: torch.Tensor, cos_sin: tuple, where: tuple, pool) -> torch.Tensor:
        """`h` `[rows, hidden]` (normed) → the attention output `[rows, hidden]`; writes this
        layer's keys and values into `pool` (its `KVCache`) where it computes them."""
        rows, hd = h.shape[0], self.head_dim
        slot_mapping, tables32, row_seq32, positions32 = where
        cos, sin = cos_sin  # [rows, 1, rotated]
        q = self.q(h).to(ATTN_DTYPE).view(rows, self.heads, -1)  # [rows, heads, hd (x2)]
        gate = None
        if self.gated:
            q, gate = q.split([hd, hd], dim=-1)  # [rows, heads, hd] each
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
        q = apply_rope(q, cos, sin)
        if self.writes:
            pool.write(0, slot_mapping, *self._keys_values(h, cos, sin))
        attn = ragged_attention(q.contiguous(), pool.keys[0], pool.values[0], tables32,
                                row_seq32, positions32, self.scale, self.window)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)  # [rows, heads, hd]
        return self.o(attn.reshape(rows, self.heads * hd).to(h.dtype))

    def _keys_values(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values `[rows, kv_heads, hd]` (float32) for the cache."""
        rows = h.shape[0]
        kv = self.kv(h).to(ATTN_DTYPE).view(rows, -1, self.kv_heads, self.head_dim)
        k = kv[:, 0]  # [rows, kv_heads, hd]
        v = k if self.k_eq_v else kv[:, 1]  # the keys before their norm and rope
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.eps)
        if self.value_norm:
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return apply_rope(k, cos, sin), v
