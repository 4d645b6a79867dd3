"""Tiny random checkpoints built in the tests (Hugging Face directories and GGUF files)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 112


# Llama 3.1's rope scaling over a context short enough that a tiny test's positions reach the
# scaled wavelengths
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# What sets each architecture's tiny model apart: head_dim other than hidden / heads (qwen3),
# sliding windows shorter than the test prompts (gemma3: layers 0-4 of 6 slide, as its pattern
# of 6 gives; mistral: every layer), gemma3's query scale and logit soft-capping; weights 5x
# wider than the default initialization, so the logits spread over several units.
WIDE = {"initializer_range": 0.1}
ARCH_EXTRA = {
    "llama": {"rope_theta": 10000.0},
    "qwen2": {"rope_theta": 1e6},
    "llama3": {"rope_parameters": LLAMA3_ROPE, **WIDE},
    "mistral": {"rope_theta": 10000.0, "sliding_window": 5, **WIDE},
    "qwen3": {"rope_theta": 1e6, "head_dim": 32, **WIDE},
    "gemma3": {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
               "final_logit_softcapping": 10.0, **WIDE},
}


def hf_config(arch: str, vocab: int = VOCAB, tie: bool = False, layers: int = 2,
              hidden_size: int = 64, intermediate_size: int = 128, **extra):
    """A `transformers` config of `arch` (a key of `ARCH_EXTRA`); `extra` overrides its fields."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    cls = {"llama": transformers.LlamaConfig, "llama3": transformers.LlamaConfig,
           "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
           "qwen3": transformers.Qwen3Config, "gemma3": transformers.Gemma3TextConfig}[arch]
    return cls(**common, **(ARCH_EXTRA[arch] | extra))


def build_hf_model(arch: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **kw)
    cls = {"llama": transformers.LlamaForCausalLM, "llama3": transformers.LlamaForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[arch]
    model = cls(cfg).float().eval()
    with torch.no_grad():  # make biases and norms non-trivial so parity means something
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_dir(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, model.config.vocab_size)
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer with `vocab` entries: 3 specials, then single characters and a
    few merges, so any ASCII text encodes."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]  # printable ASCII, space, newline
    tokens = specials + alphabet
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]:
        if len(tokens) >= vocab:
            break
        merges.append((a, b))
        tokens.append(a + b)
    tokens = tokens[:vocab] + [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges[: max(0, vocab - 99)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials + [t for t in tokens if t.startswith("<extra_")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))


# ---- GGUF files written with the `gguf` package's writer ------------------------------------

_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
# llama.cpp's names for gemma3's sandwich norms
_GGUF_GEMMA3 = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# the GGUF architecture each tiny model is written as (Llama 3.x and Mistral files are llama's)
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2",
             "qwen3": "qwen3", "gemma3": "gemma3"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    names = _GGUF_LAYER | _GGUF_GEMMA3 if arch == "gemma3" else _GGUF_LAYER
    return f"blk.{layer}.{names[rest]}"


def rope_theta(cfg) -> float:
    params = cfg.rope_parameters
    return float((params.get("full_attention") or params)["rope_theta"])


def llama3_rope_freqs(cfg):
    """The `rope_freqs` factors llama.cpp's converter writes for "llama3" rope scaling
    (`LlamaModel.generate_extra_tensors` in its convert_hf_to_gguf.py)."""
    import math

    r = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (r["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (r["original_max_position_embeddings"], r["low_freq_factor"],
                              r["high_freq_factor"], r["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The row permutation llama.cpp's converter applies to llama Q/K projections."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_KQUANT_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantize_raw(values, qtype, rng):
    """Bytes of `values` ([rows, cols] float32 numpy) in `qtype`. K-quants (which the `gguf`
    package cannot quantize) get random blocks with small finite scales instead."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype.name not in _KQUANT_SCALE_OFFSETS:
        return quants.quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _KQUANT_SCALE_OFFSETS[qtype.name]:
        scale = (rng.uniform(0.002, 0.01, size=(rows, cols // block)) * rng.choice([-1, 1], size=(rows, cols // block)) if qtype.name == "Q6_K" else rng.uniform(0.002, 0.01, size=(rows, cols // block))).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_gguf_pair(hf_model, arch: str, types: dict[str, object], path: Path, hf_path: Path, seed: int = 0,
                    extra=None, vocab_writer=None):
    """Write `hf_model`'s weights as a GGUF file, each 2-D tensor in `types[kind]` ('default',
    'embed', 'ffn', 'attn'), and a Hugging Face directory holding exactly the values the GGUF file
    dequantizes to. `extra(writer)` may add fields or tensors of its own; `vocab_writer(writer)`
    writes the tokenizer in place of the byte-level BPE one. Returns (gguf path, hf dir)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(seed)
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _add_hparams(writer, cfg, arch)
    if vocab_writer is None:
        _add_tokenizer(writer, cfg.vocab_size, arch)
    else:
        vocab_writer(writer)
    permuted = GGUF_ARCH[arch] == "llama"
    new_state = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float()
        if permuted and ("q_proj" in name or "k_proj" in name):
            w = llama_cpp_permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        kind = "embed" if "embed" in name or "lm_head" in name else "ffn" if "mlp" in name else "attn"
        qtype = types.get(kind, types["default"]) if w.dim() == 2 else T.F32
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp's converter stores Gemma's (1 + w) norms so
        arr = w.numpy()
        raw = quantize_raw(arr, qtype, rng)
        values = torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32)).reshape(w.shape)
        if permuted and ("q_proj" in name or "k_proj" in name):
            values = _unpermute(values, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        # a gemma3 norm keeps its w (the file's 1 + w is what our loader computes from it)
        new_state[name] = tensor.float() if arch == "gemma3" and name.endswith("norm.weight") else values
        writer.add_tensor(gguf_name(name, arch), raw, raw_dtype=qtype)
    if arch == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg), raw_dtype=T.F32)
    if extra is not None:
        extra(writer)
    finish_gguf(writer)
    hf_model.load_state_dict(new_state)
    save_hf_dir(hf_model, hf_path)
    return path, hf_path


def finish_gguf(writer) -> None:
    """Write a `gguf.GGUFWriter`'s header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_hparams(writer, cfg, arch: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim and head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "mistral" and cfg.sliding_window is not None:
        raise ValueError("a windowed Mistral model has no GGUF form here (llama.cpp writes none)")
    if arch == "gemma3":  # what llama.cpp fixes in code must hold for the tiny model
        if cfg.query_pre_attn_scalar != cfg.head_dim or any(
                (t == "sliding_attention") != bool((i + 1) % 6) for i, t in enumerate(cfg.layer_types)):
            raise ValueError("gemma3 GGUF files imply query_pre_attn_scalar = head_dim and a "
                             "sliding pattern of 6")
        if head_dim == cfg.hidden_size // cfg.num_attention_heads:  # not written above
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _add_tokenizer(writer, vocab: int, arch: str) -> None:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d), vocab)
        model = json.loads((Path(d) / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


def load_int8_pair(tmp_path_factory):
    """A target (seed 0) and a draft (seed 1) qwen2 tiny model, loaded float32 with int8
    weights: the speculative tests' pair."""
    from specserve.weights.loader import load_model

    target = build_hf_model("qwen2", seed=0)
    other = build_hf_model("qwen2", seed=1)
    t = load_model(save_hf_dir(target, tmp_path_factory.mktemp("t")), "float32", weights="int8")
    d = load_model(save_hf_dir(other, tmp_path_factory.mktemp("d")), "float32", weights="int8")
    return t, d


def draft_spec(k, **kw) -> dict:
    """A draft-model speculative config with k drafts (the draft passed to LLM separately)."""
    return {"method": "draft_model", "model": "draft", "num_speculative_tokens": k, **kw}


def greedy(n: int):
    """Greedy sampling of exactly `n` tokens (EOS ignored)."""
    from specserve.sampling.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
