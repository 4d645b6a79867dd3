"""What the hybrid decoders (`qwen35`, `gemma4`) add to `ModelConfig`, and its checks.

Qwen3.5 (text): most layers are Gated DeltaNet linear attention (`linear_layers`, dimensions in
`LinearAttention`); the others are full attention whose query projection also gives a
per-head output gate (`attn_output_gate`) and whose rotary embedding turns only the leading
`rotary_dim` dims of each head. Gemma 4 (text): Gemma 3's sliding/global layout, with global
layers of their own head size, KV heads and rotary embedding (`GlobalAttention`: "proportional"
rope turns `rope_angles` of the head_dim / 2 pairs), values RMS-normed without a weight
(`value_norm`), the last `kv_shared_layers` layers reusing the keys and values of the last
earlier layer of their kind, and per-layer token embeddings (`per_layer_input`) mixed into the
residual stream after each layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """A Gated DeltaNet layer's dimensions: key heads (query heads alike) of `k_head_dim`, value
    heads of `v_head_dim` (each key head serves num_v_heads / num_k_heads consecutive value
    heads), and the causal depthwise convolution's kernel over the q/k/v channels."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
            _positive_int(f"linear_attention.{name}", getattr(self, name))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_attention: num_k_heads ({self.num_k_heads}) must divide "
                             f"num_v_heads ({self.num_v_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class GlobalAttention:
    """Gemma 4's full-attention layers: their head size and KV heads, keys reused as values
    (`k_eq_v`: no v_proj), and a rotary embedding of base `rope_theta` over the first
    `rope_angles` of the head_dim / 2 rotate-half pairs (frequencies base^(-2i / head_dim),
    divided by `rope_factor`; the other pairs pass unturned)."""

    head_dim: int
    num_kv_heads: int
    k_eq_v: bool
    rope_theta: float
    rope_angles: int
    rope_factor: float = 1.0

    def __post_init__(self) -> None:
        _positive_int("global_attention.head_dim", self.head_dim)
        _positive_int("global_attention.num_kv_heads", self.num_kv_heads)
        if self.head_dim % 2 or not 0 <= self.rope_angles <= self.head_dim // 2:
            raise ValueError(f"global_attention: rope_angles ({self.rope_angles}) must lie in "
                             f"0..head_dim / 2 of an even head_dim ({self.head_dim})")
        for name in ("rope_theta", "rope_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"global_attention.{name} must be a positive number, "
                                 f"got {value!r}")


def check_hybrid(c) -> None:
    """Cross-field rules of the hybrid fields of a `ModelConfig` `c` (ValueError naming them)."""
    bad = [i for i in c.linear_layers if not 0 <= i < c.num_layers]
    if bad:
        raise ValueError(f"linear_layers: layer {bad[0]} outside 0..{c.num_layers - 1}")
    if c.linear_layers and c.linear_attention is None:
        raise ValueError("linear_layers need linear_attention dimensions")
    rd = c.rotary_dim
    if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2
                           or rd > c.head_dim):
        raise ValueError(f"rotary_dim must be an even integer in 2..head_dim ({c.head_dim}), "
                         f"got {rd!r}")
    shared = c.kv_shared_layers
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < c.num_layers:
        raise ValueError(f"kv_shared_layers must be an integer in 0..{c.num_layers - 1}, "
                         f"got {shared!r}")
    for name in ("per_layer_input", "mtp_layers"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if c.architecture not in ("qwen35", "gemma4") and (
            c.linear_layers or rd is not None or c.attn_output_gate or c.value_norm
            or c.global_attention is not None or shared or c.per_layer_input or c.mtp_layers):
        raise ValueError(f"the {c.architecture} decoder has none of the hybrid fields "
                         f"(linear layers, gates, global attention, shared KV, per-layer inputs)")
