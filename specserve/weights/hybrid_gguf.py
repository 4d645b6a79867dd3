"""GGUF files of the hybrid decoders: llama.cpp's `qwen35` and `gemma4` architectures.

Names are llama.cpp's (the `gguf` package's `TENSOR_NAMES`); what its converter changes is
undone here, so the decoder reads the same tensors from either format:
- qwen35: every RMSNorm but the linear layers' gated one is stored as 1 + w (as our Hugging
  Face loader keeps it too); `ssm_a` holds -exp(A_log); `ssm_conv1d` drops the kernel's unit
  axis; where a key head serves several value heads, the value heads are stored "tiled"
  (v0 of every group, then v1 of every group, ...) instead of grouped by key head: the rows of
  the v part of `attn_qkv`, of `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt`, the v
  channels of `ssm_conv1d` and the columns of `ssm_out` are put back in grouped order. The
  multi-token-prediction layer follows the main layers as block `block_count -
  nextn_predict_layers`, with its `nextn.*` tensors.
- gemma4: norms stored as they are applied; `layer_output_scale` is `layer_scalar`; the global
  layers' "proportional" rope is a `rope_freqs` tensor of 1 for turned pairs and 1e30 for the
  others (read into `GlobalAttention.rope_angles`); a global layer without `attn_v` reuses its
  keys as values; the shared-KV layers have no k/v tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.models.config import ModelConfig, arch_traits
from specserve.models.hybrid_config import GlobalAttention, LinearAttention

_COMMON = {"attn_norm.weight": "input_layernorm.weight",
           "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
           "attn_v.weight": "self_attn.v_proj.weight",
           "attn_output.weight": "self_attn.o_proj.weight",
           "attn_q_norm.weight": "self_attn.q_norm.weight",
           "attn_k_norm.weight": "self_attn.k_norm.weight",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight"}
_QWEN35 = _COMMON | {"post_attention_norm.weight": "post_attention_layernorm.weight",
                     "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
                     "attn_gate.weight": "linear_attn.in_proj_z.weight",
                     "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                     "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                     "ssm_conv1d.weight": "linear_attn.conv1d.weight",
                     "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
                     "ssm_norm.weight": "linear_attn.norm.weight",
                     "ssm_out.weight": "linear_attn.out_proj.weight"}
_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight",
          "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
          "nextn.shared_head_norm.weight": "mtp.norm.weight"}
_GEMMA4 = _COMMON | {"post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                     "layer_output_scale.weight": "layer_scalar",
                     "inp_gate.weight": "per_layer_input_gate.weight",
                     "proj.weight": "per_layer_projection.weight",
                     "post_norm.weight": "post_per_layer_input_norm.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
           "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
           "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
           "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
           "rope_freqs.weight": "rope_freqs.weight"}
UNTURNED = 1e10  # a rope_freqs factor above this leaves its pair unturned


def main_layers(meta: dict, arch: str) -> int:
    """Decoder layers of the file, without the multi-token-prediction layers that follow."""
    return int(meta.get(f"{arch}.block_count", 0)) - int(meta.get(f"{arch}.nextn_predict_layers",
                                                                   0) or 0)


def hf_name(gguf_name: str, arch: str, layers: int) -> str | None:
    """The Hugging Face name of a qwen35/gemma4 tensor (`layers`: the main layers), or None."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    block, rest = int(parts[1]), parts[2]
    if arch == "qwen35" and block >= layers:  # the multi-token-prediction layer
        if rest in _NEXTN:
            return _NEXTN[rest]
        name = _QWEN35.get(rest)
        return None if name is None or name.startswith("linear_attn.") \
            else f"mtp.layers.{block - layers}.{name}"
    name = (_QWEN35 if arch == "qwen35" else _GEMMA4).get(rest)
    return None if name is None else f"model.layers.{block}.{name}"


def _int(meta: dict, arch: str, key: str, path: Path, default=None) -> int:
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
    if isinstance(value, list):  # a per-layer array: the first layer's (checked by shapes)
        value = value[0] if value else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
        raise ValueError(f"{path}: {arch}.{key} = {value!r} is not a size in 1..{1 << 24}")
    return value


def hybrid_config(meta: dict, names: set[str], path: Path, arch: str,
                  rope_freqs: torch.Tensor | None) -> dict:
    """The `ModelConfig` fields of a qwen35 or gemma4 file (`names`: its tensors; `rope_freqs`:
    its rope_freqs tensor, if any)."""
    hidden, heads = _int(meta, arch, "embedding_length", path), \
        _int(meta, arch, "attention.head_count", path)
    layers = main_layers(meta, arch)
    common = dict(architecture=arch, hidden_size=hidden, num_heads=heads, num_layers=layers,
                  intermediate_size=_int(meta, arch, "feed_forward_length", path),
                  num_kv_heads=_int(meta, arch, "attention.head_count_kv", path, heads),
                  rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
                  max_position=_int(meta, arch, "context_length", path, 4096),
                  tie_word_embeddings="output.weight" not in names, attention_bias=False,
                  rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    own = _qwen35(meta, path, layers) if arch == "qwen35" \
        else _gemma4(meta, names, path, layers, heads, rope_freqs)
    return common | arch_traits(arch, hidden) | own


def _qwen35(meta: dict, path: Path, layers: int) -> dict:
    a = "qwen35"
    head_dim = _int(meta, a, "attention.key_length", path)
    v_heads = _int(meta, a, "ssm.time_step_rank", path)
    interval = _int(meta, a, "full_attention_interval", path, 4)
    return {"head_dim": head_dim, "rotary_dim": _int(meta, a, "rope.dimension_count", path),
            "linear_layers": tuple(i for i in range(layers) if (i + 1) % interval),
            "linear_attention": LinearAttention(
                _int(meta, a, "ssm.group_count", path), v_heads,
                _int(meta, a, "ssm.state_size", path),
                _int(meta, a, "ssm.inner_size", path) // v_heads,
                _int(meta, a, "ssm.conv_kernel", path)),
            "mtp_layers": int(meta.get(f"{a}.nextn_predict_layers", 0) or 0)}


def _gemma4(meta: dict, names: set[str], path: Path, layers: int, heads: int,
            rope_freqs: torch.Tensor | None) -> dict:
    a = "gemma4"
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"{path}: {a}.attention.sliding_window_pattern must list {layers} "
                         f"booleans, got {pattern!r}")
    kv = meta.get(f"{a}.attention.head_count_kv", heads)
    kv = kv if isinstance(kv, list) else [kv] * layers
    full = [i for i in range(layers) if not pattern[i]]
    head_dim = _int(meta, a, "attention.key_length", path)
    if rope_freqs is None or rope_freqs.numel() != head_dim // 2:
        raise ValueError(f"{path}: a gemma4 file needs a rope_freqs tensor of "
                         f"{head_dim // 2} factors (its global layers' rope)")
    turned = rope_freqs < UNTURNED
    angles = int(turned.sum())
    if not bool(turned[:angles].all()) or bool((rope_freqs[:angles] != 1).any()):
        raise ValueError(f"{path}: rope_freqs other than 1 for the first pairs and 1e30 for "
                         f"the rest is not supported")
    shared = int(meta.get(f"{a}.attention.shared_kv_layers", 0) or 0)
    own = [i for i in full if f"blk.{i}.attn_k.weight" in names]  # not sharing another's KV
    k_eq_v = bool(own) and f"blk.{own[0]}.attn_v.weight" not in names
    cap = meta.get(f"{a}.final_logit_softcapping")
    return {"head_dim": _int(meta, a, "attention.key_length_swa", path),
            "num_kv_heads": int(kv[next(i for i in range(layers) if pattern[i])])
            if any(pattern) else int(kv[0]),
            "sliding_window": _int(meta, a, "attention.sliding_window", path),
            "sliding_layers": tuple(i for i in range(layers) if pattern[i]),
            "rope_local_theta": float(meta.get(f"{a}.rope.freq_base_swa", 10000.0)),
            "global_attention": GlobalAttention(
                head_dim, int(kv[full[0]]) if full else int(kv[0]), k_eq_v,
                float(meta.get(f"{a}.rope.freq_base", 10000.0)), angles),
            "kv_shared_layers": shared,
            "per_layer_input": int(meta.get(f"{a}.embedding_length_per_layer_input", 0) or 0),
            "final_logit_softcap": None if cap is None else float(cap)}


def _grouped(t: torch.Tensor, dim: int, la: LinearAttention, head: int) -> torch.Tensor:
    """Undo the converter's tiling of value heads along `dim` (`head`: each one's width)."""
    per_k = la.num_v_heads // la.num_k_heads
    shape = list(t.shape)
    tiled = t.reshape(*shape[:dim], per_k, la.num_k_heads, head, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def from_file(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """A dequantized qwen35 tensor (float32, Hugging Face `name`) as the decoder reads it."""
    la = cfg.linear_attention
    if cfg.architecture != "qwen35" or ".linear_attn." not in name:
        return t
    if name.endswith("A_log"):
        if bool((t >= 0).any()):
            raise ValueError(f"ssm_a of {name} must be negative (it stores -exp(A_log))")
        t = torch.log(-t)
    if la.num_v_heads == la.num_k_heads:
        return t.reshape(la.conv_dim, 1, la.conv_kernel) if name.endswith("conv1d.weight") else t
    qk, vd = 2 * la.key_dim, la.v_head_dim
    if name.endswith("in_proj_qkv.weight"):
        t = torch.cat([t[:qk], _grouped(t[qk:], 0, la, vd)])
    elif name.endswith("conv1d.weight"):
        t = torch.cat([t[:qk], _grouped(t[qk:], 0, la, vd)]).reshape(la.conv_dim, 1, -1)
    elif name.endswith("in_proj_z.weight"):
        t = _grouped(t, 0, la, vd)
    elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        t = _grouped(t, 0, la, 1)
    elif name.endswith("out_proj.weight"):
        t = _grouped(t, 1, la, vd)
    return t
