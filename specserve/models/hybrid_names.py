"""The checkpoint tensors (Hugging Face names) a hybrid decoder reads: a loader refuses a
checkpoint that lacks one or holds one not listed here."""

from __future__ import annotations

from specserve.models.config import ModelConfig
from specserve.models.hybrid_attention import kv_sources

_LINEAR = ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
           "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
           "linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
           "linear_attn.norm.weight", "linear_attn.out_proj.weight"]
_MLP = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
_PLE = ["per_layer_input_gate.weight", "per_layer_projection.weight",
        "post_per_layer_input_norm.weight"]
MTP_GLOBAL = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
              "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"]


def attention_names(cfg: ModelConfig, index: int, writes: bool) -> list[str]:
    """Attention layer `index`'s tensors (after its prefix); `writes`: it computes its own
    keys and values (not one of Gemma 4's shared layers)."""
    names = ["self_attn.q_proj.weight", "self_attn.o_proj.weight"]
    names += ["self_attn.q_norm.weight"] if cfg.qk_norm else []
    if writes:
        names += ["self_attn.k_proj.weight"] + (["self_attn.k_norm.weight"] if cfg.qk_norm else [])
        ga = cfg.global_attention
        if not (ga is not None and ga.k_eq_v and index not in cfg.sliding_layers):
            names.append("self_attn.v_proj.weight")
    return names


def block_names(cfg: ModelConfig, index: int, kv_source: int | None) -> list[str]:
    """Every tensor of decoder layer `index` (after `model.layers.{index}.`)."""
    mixer = _LINEAR if kv_source is None else attention_names(cfg, index, kv_source == index)
    norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.sandwich_norms:
        norms += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    extra = _PLE if cfg.per_layer_input else []
    extra += ["layer_scalar"] if cfg.architecture == "gemma4" else []
    return mixer + _MLP + norms + extra


def tensor_names(cfg: ModelConfig) -> set[str]:
    """The full names a checkpoint of `cfg` must hold (`lm_head.weight` is optional)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i, source in enumerate(kv_sources(cfg)):
        names |= {f"model.layers.{i}.{n}" for n in block_names(cfg, i, source)}
    if cfg.per_layer_input:
        names |= {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                  "model.per_layer_projection_norm.weight"}
    for j in range(cfg.mtp_layers):
        names |= set(MTP_GLOBAL) | {f"mtp.layers.{j}.{n}" for n in block_names(cfg, 0, 0)}
    return names
