"""Load a GGUF file (`llama`, `qwen2`, `qwen3`, `gemma3`, and the hybrid `qwen35` and
`gemma4` of `hybrid_gguf.py`) into Hugging Face-named tensors.

llama.cpp's converter permutes the rows of `llama` Q/K projections so that rotary pairs sit
next to each other; we undo it so one rotate-half decoder serves every architecture. The
others are not permuted; `qwen2` files carry q/k/v biases. Mistral-style files are `llama`
files. `gemma3` files store their norms as 1 + w already, and leave what llama.cpp fixes in
code out of the metadata (the sliding layers' rope base 10000, every 6th layer global, the
query scale), which `_gemma3` restores the same way. A tensor the decoder does not implement
is refused by name, never left out; Llama 3.x's `rope_freqs` (its "llama3" rope scaling) is
read as the rotary embedding's per-pair factors. Tensors are dequantized one at a time into the
target dtype straight from the file's memory map (`gguf_file.GGUFFile`), so peak memory stays
near the final model size.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from specserve.models.config import (HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES,
                                     ModelConfig, arch_traits)
from specserve.weights import hybrid_gguf
from specserve.weights.dequant import dequantize
from specserve.weights.gguf_file import GGUFFile, GGUFTensor
from specserve.weights.hf_loader import check_tensor_names
from specserve.weights.rope_config import gguf_rope

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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# gemma3's sandwich norms: its ffn_norm is the MLP's input norm, as in llama, under another name
_GEMMA3_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
                 "rope_freqs.weight": "rope_freqs.weight"}


def open_gguf(path: Path) -> GGUFFile:
    """Parse the header of a GGUF file; any unreadable file raises ValueError naming it."""
    try:
        return GGUFFile(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file ({e.strerror or e})") from e


def read_metadata(gguf_file: GGUFFile) -> dict:
    """All key/value fields as Python values (strings, numbers, lists; a long string array,
    such as the vocabulary, as a `gguf_file.StringArray`: a sequence read on first use)."""
    return dict(gguf_file.metadata)


def config_from_metadata(meta: dict, tensor_names: set[str], path: Path,
                         rope_freqs: torch.Tensor | None = None,
                         shapes: dict[str, tuple[int, ...]] | None = None) -> ModelConfig:
    """The decoder's configuration (`rope_freqs`: the file's rope_freqs tensor, which holds
    gemma4's global rope). `shapes` (Hugging Face name → shape): every size the metadata
    states is checked against them (`check_sizes`) before anything is derived from it."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch in HYBRID_ARCHITECTURES:
        fields = hybrid_gguf.hybrid_config(meta, tensor_names, path, arch, rope_freqs)
        vocab = meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))
        try:
            return ModelConfig(vocab_size=int(vocab), **fields)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    sizes = check_sizes(meta, arch, shapes or {}, path)
    hidden, heads, head_dim = sizes["embedding_length"], sizes["attention.head_count"], \
        sizes["attention.key_length"]
    layers = sizes["block_count"]
    rope = gguf_rope(meta, arch, head_dim, path)
    if meta.get(f"{arch}.attn_logit_softcapping") is not None:
        raise ValueError(f"{path}: attention logit soft-capping is not supported")
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None and arch != "gemma3":
        raise ValueError(f"{path}: sliding-window attention in a {arch} GGUF file is not "
                         f"supported")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["feed_forward_length"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=sizes["attention.head_count_kv"],
            head_dim=head_dim,
            rope_theta=rope.theta,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position=sizes["context_length"],
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2",
            rope_scaling=rope.scaling,
            **arch_traits(arch, hidden),
            **(_gemma3(meta, layers, hidden, heads, head_dim, rope.local_theta, path)
               if arch == "gemma3" else {}),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# Bounds of the sizes a GGUF file states, far above any released model's: a larger value is a
# lie that would allocate gigabytes (a rotary table, a pass's buffers) before anything else
# could notice it.
SIZE_BOUNDS = {"embedding_length": 1 << 17, "block_count": 1 << 12,
               "attention.head_count": 1 << 12, "attention.head_count_kv": 1 << 12,
               "attention.key_length": 1 << 12, "feed_forward_length": 1 << 20,
               "vocab_size": 1 << 24, "context_length": 1 << 24}


def _stated(meta: dict, arch: str, name: str, default, path: Path) -> int:
    """The size `{arch}.{name}` states (or `default`), a positive integer within its bound."""
    value = meta.get(f"{arch}.{name}", default)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{path}: {arch}.{name} must be one integer, got {value!r}")
    if not 1 <= value <= SIZE_BOUNDS[name]:
        raise ValueError(f"{path}: {arch}.{name} = {value} is outside 1..{SIZE_BOUNDS[name]}")
    return int(value)


def check_sizes(meta: dict, arch: str, shapes: dict[str, tuple[int, ...]],
                path: Path) -> dict[str, int]:
    """Every size the metadata of a `llama`/`qwen2`/`qwen3`/`gemma3` file states (`SIZE_BOUNDS`'
    names; vocab_size defaults to the vocabulary's length), within its bound and, where
    `shapes` holds the tensors (Hugging Face names), equal to what their shapes say: a lie
    raises ValueError naming the field. Nothing is allocated from a size before this."""
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_key = f"{arch}.vocab_size" if f"{arch}.vocab_size" in meta else "tokenizer.ggml.tokens"
    s = {"embedding_length": _stated(meta, arch, "embedding_length", None, path),
         "block_count": _stated(meta, arch, "block_count", None, path),
         "attention.head_count": _stated(meta, arch, "attention.head_count", None, path),
         "feed_forward_length": _stated(meta, arch, "feed_forward_length", None, path),
         "context_length": _stated(meta, arch, "context_length", 4096, path),
         "vocab_size": _stated(meta, arch, "vocab_size",
                               len(tokens) if tokens is not None else None, path)}
    heads, hidden = s["attention.head_count"], s["embedding_length"]
    s["attention.head_count_kv"] = _stated(meta, arch, "attention.head_count_kv", heads, path)
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise ValueError(f"{path}: {arch}.attention.head_count = {heads} does not divide "
                         f"{arch}.embedding_length = {hidden} (and no key_length is stated)")
    s["attention.key_length"] = _stated(meta, arch, "attention.key_length", hidden // heads, path)
    if shapes:
        _match_shapes(s, arch, shapes, vocab_key, path)
    return s


def _match_shapes(s: dict[str, int], arch: str, shapes: dict[str, tuple[int, ...]],
                  vocab_key: str, path: Path) -> None:
    """`check_sizes`' comparison of the stated sizes `s` with the tensors' shapes."""
    def mismatch(what: str, want: tuple, name: str) -> None:
        got = shapes.get(name)
        if got is not None and tuple(got) != want:
            raise ValueError(f"{path}: {what} give {name} the shape {want}; the file's is "
                             f"{tuple(got)}")

    hidden, vocab = s["embedding_length"], s["vocab_size"]
    hd, heads, kv = s["attention.key_length"], s["attention.head_count"], \
        s["attention.head_count_kv"]
    mismatch(f"{arch}.embedding_length = {hidden} and {vocab_key} = {vocab}",
             (vocab, hidden), "model.embed_tokens.weight")
    mismatch(f"{arch}.embedding_length = {hidden} and {vocab_key} = {vocab}", (vocab, hidden),
             "lm_head.weight")
    present = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")}
    if present != set(range(s["block_count"])):
        raise ValueError(f"{path}: {arch}.block_count = {s['block_count']}, but the file holds "
                         f"the tensors of {len(present)} layers")
    heads_of = f"{arch}.attention.head_count = {heads} and {arch}.attention.key_length = {hd}"
    kv_of = f"{arch}.attention.head_count_kv = {kv} and {arch}.attention.key_length = {hd}"
    ffn = f"{arch}.feed_forward_length = {s['feed_forward_length']}"
    for i in sorted(present):
        at = f"model.layers.{i}."
        mismatch(f"{arch}.embedding_length = {hidden}", (hidden,), at + "input_layernorm.weight")
        mismatch(f"{heads_of}, {arch}.embedding_length = {hidden}", (heads * hd, hidden),
                 at + "self_attn.q_proj.weight")
        mismatch(f"{kv_of}, {arch}.embedding_length = {hidden}", (kv * hd, hidden),
                 at + "self_attn.k_proj.weight")
        mismatch(f"{kv_of}, {arch}.embedding_length = {hidden}", (kv * hd, hidden),
                 at + "self_attn.v_proj.weight")
        mismatch(f"{heads_of}, {arch}.embedding_length = {hidden}", (hidden, heads * hd),
                 at + "self_attn.o_proj.weight")
        for part in ("gate", "up"):
            mismatch(f"{ffn}, {arch}.embedding_length = {hidden}",
                     (s["feed_forward_length"], hidden), at + f"mlp.{part}_proj.weight")
        mismatch(f"{ffn}, {arch}.embedding_length = {hidden}",
                 (hidden, s["feed_forward_length"]), at + "mlp.down_proj.weight")


def _gemma3(meta: dict, layers: int, hidden: int, heads: int, head_dim: int,
            local_theta: float, path: Path) -> dict:
    """What llama.cpp's `gemma3` loader derives: every 6th layer global (or the file's
    `sliding_window_pattern`), query scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the
    62-layer 27B model, whose query_pre_attn_scalar is that)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{path}: gemma3.attention.sliding_window_pattern {pattern!r} is not "
                         f"supported (a positive integer expected)")
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise ValueError(f"{path}: GGUF metadata lacks gemma3.attention.sliding_window")
    cap = meta.get("gemma3.final_logit_softcapping")
    return {"sliding_window": int(window),
            "sliding_layers": tuple(i for i in range(layers) if (i + 1) % pattern),
            "rope_local_theta": local_theta,
            "attn_scale": 1 / math.sqrt(hidden / heads if layers == 62 else head_dim),
            "final_logit_softcap": None if cap is None else float(cap)}


def hf_name(gguf_name: str, arch: str = "llama", layers: int = 0) -> str | None:
    """The Hugging Face name of a tensor (`layers`: the main decoder layers of a qwen35 file,
    whose multi-token-prediction layer follows them)."""
    if arch in HYBRID_ARCHITECTURES:
        return hybrid_gguf.hf_name(gguf_name, arch, layers)
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        name = (_GEMMA3_NAMES.get(parts[2]) if arch == "gemma3" else None) \
            or _LAYER_NAMES.get(parts[2])
        if name is not None:
            return f"model.layers.{parts[1]}.{name}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection ([out, in] or [out])."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_gguf(gguf_file: GGUFFile, meta: dict) -> ModelConfig:
    """The decoder's configuration, once the file is known to hold every tensor it needs."""
    freqs = next((t for t in gguf_file.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        freqs = dequantize(gguf_file.raw(freqs), freqs.qtype, freqs.shape, name=freqs.name)
    index = tensor_index(gguf_file)
    cfg = config_from_metadata(meta, {t.name for t in gguf_file.tensors}, gguf_file.path, freqs,
                               {n: t.shape for n, t in index.items()})
    _check_complete(cfg, index, gguf_file.path)
    return cfg


def tensor_index(gguf_file: GGUFFile) -> dict[str, GGUFTensor]:
    """The file's tensors by Hugging Face name; one the decoder does not implement raises
    ValueError naming it (it is never left out)."""
    arch = gguf_file.metadata.get("general.architecture")
    layers = hybrid_gguf.main_layers(gguf_file.metadata, arch)
    index, unknown = {}, []
    for t in gguf_file.tensors:
        name = hf_name(t.name, arch, layers)
        if name is None:
            unknown.append(t.name)
        else:
            index[name] = t
    if unknown:
        raise ValueError(f"{gguf_file.path}: tensors {unknown[:5]} are not implemented by the "
                         f"{arch} decoder")
    return index


def read_tensor(gguf_file: GGUFFile, cfg: ModelConfig, tensor: GGUFTensor,
                dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized from the file's memory map into `dtype` (llama's Q/K rows
    unpermuted; `rope_freqs` in float32)."""
    try:
        w = dequantize(gguf_file.raw(tensor), tensor.qtype, tensor.shape, name=tensor.name)
    except ValueError as e:  # e.g. a quantization type the decoder does not support
        raise ValueError(f"{gguf_file.path}: {e}") from e
    name = hf_name(tensor.name, cfg.architecture, cfg.num_layers) or ""
    if cfg.architecture in HYBRID_ARCHITECTURES:
        try:
            w = hybrid_gguf.from_file(cfg, name, w.float())
        except ValueError as e:
            raise ValueError(f"{gguf_file.path}: {e}") from None
    if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = unpermute(w, cfg.num_heads)
    elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = unpermute(w, cfg.num_kv_heads)
    if name == "rope_freqs.weight":  # frequency factors stay float32 whatever the weights' dtype
        return w.float()
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
    check_tensor_names(cfg, set(weights) - {"rope_freqs.weight"}, path)
    if "rope_freqs.weight" in weights and cfg.architecture not in ("llama", "gemma4"):
        raise ValueError(f"{path}: a rope_freqs tensor in a {cfg.architecture} file is not "
                         f"supported")
