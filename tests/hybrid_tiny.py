"""Tiny random Qwen3.5 and Gemma 4 checkpoints: `transformers` models, Hugging Face directories
(optionally with a random multi-token-prediction head) and float32 GGUF files written as
llama.cpp's converter writes them (its names, from the `gguf` package's tensor map; its
tensor changes, redone here independently of the loader that undoes them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests import tiny

QWEN35 = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=1024,
              rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
# every Gemma 4 feature at once: per-layer inputs, the last 2 layers sharing KV, global layers
# of their own head size and one KV head reused as values, double-wide MLPs on shared layers
GEMMA4 = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 3,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=tiny.VOCAB,
              num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1,
              use_double_wide_mlp=True, final_logit_softcapping=10.0,
              max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# and none of them: a plain sliding/global model with separate values and an untied head
GEMMA4_PLAIN = GEMMA4 | dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                             attention_k_eq_v=False, use_double_wide_mlp=False,
                             final_logit_softcapping=None, tie_word_embeddings=False)
CONFIGS = {"qwen35": QWEN35, "gemma4": GEMMA4, "gemma4-plain": GEMMA4_PLAIN}


def build(kind: str, seed: int = 0, **extra):
    """A float32 `transformers` model of `kind` (a key of CONFIGS), norms, biases and layer
    scalars made non-trivial so that parity means something."""
    import transformers

    torch.manual_seed(seed)
    if kind == "qwen35":
        cfg = transformers.Qwen3_5TextConfig(**(QWEN35 | extra))
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Gemma4TextConfig(**(CONFIGS[kind] | extra))
        model = transformers.Gemma4ForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model


def save(model, path: Path, mtp_seed: int | None = None) -> Path:
    """A Hugging Face directory of `model`; with `mtp_seed`, plus a random multi-token-
    prediction head (`mtp.*`, one full-attention layer) as Qwen3.5 checkpoints carry."""
    tiny.save_hf_dir(model, path)
    if mtp_seed is not None:
        weights = load_file(str(path / "model.safetensors"))
        weights.update(mtp_tensors(model, mtp_seed))
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    return path


def mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP head for a qwen35 `model`: fc [hidden, 2 hidden], its norms, and a
    full-attention decoder layer shaped as the model's own full-attention layers."""
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    hidden = model.config.hidden_size
    out = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.1
    prefix = f"model.layers.{full}."
    for name, t in state.items():
        if name.startswith(prefix):
            out["mtp.layers.0." + name[len(prefix):]] = torch.randn(t.shape, generator=g) * 0.1
    return out


# ---- GGUF --------------------------------------------------------------------------------

def _tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head: int) -> torch.Tensor:
    """The converter's reorder of value heads from grouped (by key head) to tiled."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k_heads, per_k, head, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensor(name: str, t: torch.Tensor, cfg) -> tuple[str, torch.Tensor]:
    """(name as llama.cpp's converter maps it before the tensor map, the tensor it writes)."""
    kh, vh, kd, vd = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    per_k, qk = vh // kh, 2 * kh * kd
    if ".linear_attn." in name:
        if name.endswith("in_proj_qkv.weight"):
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, kh, per_k, vd)])
        elif name.endswith("in_proj_z.weight"):
            t = _tiled(t, 0, kh, per_k, vd)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = _tiled(t, 0, kh, per_k, 1)
        elif name.endswith("conv1d.weight"):
            t = t.squeeze(1)
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, kh, per_k, vd)])
        elif name.endswith("out_proj.weight"):
            t = _tiled(t, 1, kh, per_k, vd)
        if name.endswith("A_log"):
            t = -torch.exp(t)
        if name.endswith("dt_bias"):
            name = name.replace("dt_bias", "dt_proj.bias")
    elif name.endswith("norm.weight"):
        t = t + 1
    return name, t


def _gguf_names(arch, blocks: int):
    import gguf

    return gguf.get_tensor_name_map(arch, blocks)


def write_gguf(model, kind: str, path: Path, mtp: dict[str, torch.Tensor] | None = None,
               extra=None) -> Path:
    """A float32 GGUF file of `model` (qwen35 with an optional MTP head `mtp`, or gemma4);
    `extra(writer)` may add tensors of its own."""
    import gguf

    cfg = model.config
    arch = "qwen35" if kind == "qwen35" else "gemma4"
    writer = gguf.GGUFWriter(str(path), arch)
    blocks = cfg.num_hidden_layers + (1 if mtp else 0)
    names = _gguf_names(gguf.MODEL_ARCH.QWEN35 if arch == "qwen35" else gguf.MODEL_ARCH.GEMMA4,
                        blocks)
    (_qwen35_meta if arch == "qwen35" else _gemma4_meta)(writer, cfg, blocks)
    tiny._add_tokenizer(writer, cfg.vocab_size, arch)
    state = {n: t.float() for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # the file has no output tensor
    for name, t in list(state.items()) + list(_mtp_as_layer(mtp or {}, cfg).items()):
        name, t = _qwen35_tensor(name, t, cfg) if arch == "qwen35" else (name, t)
        writer.add_tensor(_gguf_name(names, name), t.contiguous().numpy())
    if arch == "gemma4":
        writer.add_tensor("rope_freqs.weight", _gemma4_rope_freqs(cfg).numpy())
    if extra is not None:
        extra(writer)
    tiny.finish_gguf(writer)
    return path


_NEXTN = {"fc": "nextn.eh_proj", "pre_fc_norm_embedding": "nextn.enorm",
          "pre_fc_norm_hidden": "nextn.hnorm", "norm": "nextn.shared_head_norm"}


def _mtp_as_layer(mtp: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The MTP tensors renamed as the converter does: its layer becomes block L."""
    out, block = {}, cfg.num_hidden_layers
    for name, t in mtp.items():
        parts = name.split(".", 3)
        if parts[1] == "layers":
            out[f"model.layers.{block}.{parts[3]}"] = t
        else:
            out[f"blk.{block}.{_NEXTN[parts[1]]}.weight"] = t
    return out


def _gguf_name(names, name: str) -> str:
    if name.startswith("blk."):
        return name
    if name.endswith(("A_log", "layer_scalar")):
        found = names.get_name(name)
        return found if name.endswith("A_log") else found + ".weight"
    found = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert found is not None, name
    return found


def _qwen35_meta(w, cfg, blocks: int) -> None:
    w.add_block_count(blocks)
    if blocks > cfg.num_hidden_layers:
        w.add_nextn_predict_layers(blocks - cfg.num_hidden_layers)
    _common_meta(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    types = cfg.layer_types
    interval = types.index("full_attention") + 1
    assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
    w.add_full_attention_interval(interval)


def _common_meta(w, cfg) -> None:
    d = cfg.to_dict()  # Gemma 4's per-layer view refuses the ambiguous attributes
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_feed_forward_length(d["intermediate_size"])


def _gemma4_meta(w, cfg, blocks: int) -> None:
    w.add_block_count(blocks)
    _common_meta(w, cfg)
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    if cfg.use_double_wide_mlp:
        w.add_feed_forward_length([cfg.intermediate_size * (1 if i < first_shared else 2)
                                   for i in range(blocks)])
    d = cfg.to_dict()
    full = cfg.per_layer_config[swa.index(False)]
    w.add_head_count_kv([d["num_key_value_heads"] if s else full.num_key_value_heads
                         for s in swa])
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(d["head_dim"])
    w.add_value_length_swa(d["head_dim"])
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(d["head_dim"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(cfg.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _gemma4_rope_freqs(cfg) -> torch.Tensor:
    """The converter's encoding of the global layers' proportional rope."""
    hd = cfg.per_layer_config[cfg.layer_types.index("full_attention")].head_dim
    turned = int(hd * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return torch.tensor([1.0] * turned + [1e30] * (hd // 2 - turned), dtype=torch.float32)
