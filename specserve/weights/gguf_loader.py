"""Load a GGUF file (`qwen2` or `llama` architecture) into Hugging Face-named tensors.

llama.cpp's converter permutes the rows of `llama` Q/K projections so that rotary pairs sit
next to each other; we undo it so one rotate-half decoder serves both architectures. `qwen2`
files are not permuted and carry q/k/v biases. Tensors are dequantized one at a time into the
target dtype straight from the file's memory map (`gguf_file.GGUFFile`), so peak memory stays
near the final model size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES

from specserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specserve.weights.dequant import dequantize
from specserve.weights.gguf_file import GGUFFile, GGUFTensor

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def open_gguf(path: Path) -> GGUFFile:
    """Parse the header of a GGUF file; any unreadable file raises ValueError naming it."""
    try:
        return GGUFFile(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file ({e.strerror or e})") from e


def read_metadata(gguf_file: GGUFFile) -> dict:
    """All key/value fields as Python values (strings, numbers, lists)."""
    return dict(gguf_file.metadata)


def config_from_metadata(meta: dict, tensor_names: set[str], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_scaling = meta.get(f"{arch}.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ValueError(f"{path}: rope scaling {rope_scaling!r} is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection ([out, in] or [out])."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_gguf(gguf_file: GGUFFile, meta: dict) -> ModelConfig:
    """The decoder's configuration, once the file is known to hold every tensor it needs."""
    cfg = config_from_metadata(meta, {t.name for t in gguf_file.tensors}, gguf_file.path)
    _check_complete(cfg, tensor_index(gguf_file), gguf_file.path)
    return cfg


def tensor_index(gguf_file: GGUFFile) -> dict[str, GGUFTensor]:
    """The file's tensors this decoder uses, by Hugging Face name (e.g. rope_freqs is left out)."""
    return {name: t for t in gguf_file.tensors if (name := hf_name(t.name)) is not None}


def read_tensor(gguf_file: GGUFFile, cfg: ModelConfig, tensor: GGUFTensor,
                dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized from the file's memory map into `dtype` (llama's Q/K rows
    unpermuted)."""
    try:
        w = dequantize(gguf_file.raw(tensor), tensor.qtype, tensor.shape, name=tensor.name)
    except ValueError as e:  # e.g. a quantization type the decoder does not support
        raise ValueError(f"{gguf_file.path}: {e}") from e
    name = hf_name(tensor.name) or ""
    if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = unpermute(w, cfg.num_heads)
    elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = unpermute(w, cfg.num_kv_heads)
    return w.to(dtype)


def tensor_bits(path_or_file: Path | GGUFFile) -> dict[str, float]:
    """Bits per weight each tensor is stored with in the file, by Hugging Face name (Q4_K:
    4.5, Q6_K: 6.56, F16: 16, ...)."""
    gguf_file = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    return {name: 8.0 * GGML_QUANT_SIZES[t.qtype][1] / GGML_QUANT_SIZES[t.qtype][0]
            for name, t in tensor_index(gguf_file).items()}


def is_quantized(source_bits: dict[str, float]) -> bool:
    """Whether a file stores its projections quantized (below 16 bits per weight), so that
    `weights="auto"` keeps them quantized."""
    return any(bits < 16 for name, bits in source_bits.items() if name.endswith("_proj.weight"))


def _check_complete(cfg: ModelConfig, weights: dict, path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}" for i in range(cfg.num_layers)
        for n in _LAYER_NAMES.values() if cfg.attention_bias or not n.endswith("bias")]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
