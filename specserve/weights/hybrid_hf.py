"""The `config.json` fields of `Qwen3_5ForCausalLM` (`qwen35`) and `Gemma4ForCausalLM`
(`gemma4`), read into `ModelConfig` fields; an option the hybrid decoder does not implement is
refused by name, never dropped.

Defaults follow `transformers`' own (`Qwen3_5TextConfig`: partial rotary factor 0.25, a full
attention layer every 4th; `Gemma4TextConfig`: global head_dim 512, rope "default" base 10000
on sliding layers and "proportional" 0.25 base 1e6 on global ones, the last layer global).
Qwen3.5's interleaved multimodal rope (`mrope_section`) turns every section by the same text
position, so for text it is the plain rotary embedding of the leading dims.
"""

from __future__ import annotations

from specserve.models.hybrid_config import GlobalAttention, LinearAttention

_QWEN35_TYPES = ("linear_attention", "full_attention")
_GEMMA4_TYPES = ("sliding_attention", "full_attention")


def _rope_params(field, default: dict) -> dict:
    params = field.raw.get("rope_parameters")
    if params is None:
        return default
    if not isinstance(params, dict):
        raise ValueError(f"{field.file}: field 'rope_parameters' must be an object, "
                         f"got {params!r}")
    return params


def _layer_types(field, layers: int, kinds: tuple[str, str], default: list[str]) -> list[str]:
    types = field.raw.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise ValueError(f"{field.file}: field 'layer_types' must list {layers} of "
                         f"{', '.join(kinds)}, got {types!r}")
    return list(types)


def _refuse(field, name: str, allowed: object, what: str) -> None:
    value = field.raw.get(name)
    if value is not None and value != allowed:
        raise ValueError(f"{field.file}: {what} ({name}={value!r}) is not supported")


def qwen35_fields(field, layers: int, head_dim: int) -> dict:
    """The `qwen35` fields of a `config.json` (`field`: its `_FieldReader`)."""
    _refuse(field, "attention_bias", False, "attention biases")
    _refuse(field, "hidden_act", "silu", "an MLP activation other than silu")
    params = _rope_params(field, {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"{field.file}: rope scaling {kind!r} is not supported for qwen35; "
                         f"supported: default")
    factor = params.get("partial_rotary_factor", field.raw.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"{field.file}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    interval = field.int("full_attention_interval", 4)
    types = _layer_types(field, layers, _QWEN35_TYPES,
                         ["linear_attention" if (i + 1) % interval else "full_attention"
                          for i in range(layers)])
    linear = LinearAttention(field.int("linear_num_key_heads", 16),
                             field.int("linear_num_value_heads", 32),
                             field.int("linear_key_head_dim", 128),
                             field.int("linear_value_head_dim", 128),
                             field.int("linear_conv_kernel_dim", 4))
    mtp = field.raw.get("mtp_num_hidden_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ValueError(f"{field.file}: field 'mtp_num_hidden_layers' must be a non-negative "
                         f"integer, got {mtp!r}")
    return {"rope_theta": float(params.get("rope_theta", field.raw.get("rope_theta", 10000.0))),
            "rotary_dim": int(head_dim * factor),
            "linear_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
            "linear_attention": linear, "mtp_layers": mtp}


_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def gemma4_fields(field, layers: int) -> dict:
    """The `gemma4` fields of a `config.json` (`field`: its `_FieldReader`)."""
    _refuse(field, "attention_bias", False, "attention biases")
    _refuse(field, "enable_moe_block", False, "the mixture-of-experts block")
    _refuse(field, "use_bidirectional_attention", None, "bidirectional attention")
    _refuse(field, "hidden_activation", "gelu_pytorch_tanh", "an MLP activation other than "
            "gelu_pytorch_tanh")
    types = _layer_types(field, layers, _GEMMA4_TYPES,
                         ["sliding_attention" if (i + 1) % 6 else "full_attention"
                          for i in range(layers)])
    types[-1] = "full_attention"  # as transformers forces it
    params = _rope_params(field, _GEMMA4_ROPE)
    local = params.get("sliding_attention") or _GEMMA4_ROPE["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{field.file}: rope scaling {local.get('rope_type')!r} of the sliding "
                         f"layers is not supported; supported: default")
    cap = field.raw.get("final_logit_softcapping")
    return {"rope_theta": 10_000.0, "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
            "sliding_window": field.int("sliding_window", 512),
            "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            "global_attention": _global_attention(field, params, types),
            "kv_shared_layers": field.raw.get("num_kv_shared_layers") or 0,
            "per_layer_input": field.raw.get("hidden_size_per_layer_input") or 0,
            "tie_word_embeddings": field.bool("tie_word_embeddings", True),
            "final_logit_softcap": None if cap is None
            else field.number("final_logit_softcapping")}


def _global_attention(field, params: dict, types: list[str]) -> GlobalAttention:
    """The global layers' geometry: from `per_layer_config` (as transformers saves it), else
    `global_head_dim` and `num_global_key_value_heads` (as the published configs give it)."""
    k_eq_v = field.bool("attention_k_eq_v", False)
    head_dim = field.int("global_head_dim", 512)
    kv_heads = field.int("num_global_key_value_heads", field.int("num_key_value_heads")) \
        if k_eq_v else field.int("num_key_value_heads")
    per_layer = field.raw.get("per_layer_config")
    if per_layer is not None:
        full = {str(i) for i, t in enumerate(types) if t == "full_attention"}
        if not isinstance(per_layer, dict) or set(per_layer) != full or any(
                not isinstance(v, dict) or set(v) - {"head_dim", "num_key_value_heads"}
                for v in per_layer.values()):
            raise ValueError(f"{field.file}: field 'per_layer_config' must give head_dim or "
                             f"num_key_value_heads of exactly the full-attention layers, got "
                             f"{per_layer!r}")
        found = {(v.get("head_dim", head_dim), v.get("num_key_value_heads", kv_heads))
                 for v in per_layer.values()}
        if len(found) != 1:
            raise ValueError(f"{field.file}: full-attention layers of different shapes "
                             f"(per_layer_config) are not supported")
        head_dim, kv_heads = found.pop()
    full = params.get("full_attention") or _GEMMA4_ROPE["full_attention"]
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"{field.file}: rope scaling {kind!r} of the full-attention layers is "
                         f"not supported; supported: default, proportional")
    share = full.get("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0
    return GlobalAttention(head_dim, kv_heads, k_eq_v, float(full.get("rope_theta", 10_000.0)),
                           int(share * head_dim // 2),
                           float(full.get("factor", 1.0)) if kind == "proportional" else 1.0)
