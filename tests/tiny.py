"""Tiny random checkpoints built in the tests (Hugging Face directories and GGUF files)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 112


def hf_config(arch: str, vocab: int = VOCAB, tie: bool = False, layers: int = 2,
              hidden_size: int = 64, intermediate_size: int = 128):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if arch == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    return transformers.Qwen2Config(rope_theta=1e6, **common)


def build_hf_model(arch: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **kw)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
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
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


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


def write_gguf_pair(hf_model, arch: str, types: dict[str, object], path: Path, hf_path: Path, seed: int = 0):
    """Write `hf_model`'s weights as a GGUF file, each 2-D tensor in `types[kind]` ('default',
    'embed', 'ffn', 'attn'), and a Hugging Face directory holding exactly the values the GGUF file
    dequantizes to. Returns (gguf path, hf dir)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(seed)
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_tokenizer(writer, cfg.vocab_size, arch)
    new_state = {}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = llama_cpp_permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        kind = "embed" if "embed" in name or "lm_head" in name else "ffn" if "mlp" in name else "attn"
        qtype = types.get(kind, types["default"]) if w.dim() == 2 else T.F32
        arr = w.numpy()
        raw = quantize_raw(arr, qtype, rng)
        values = torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32)).reshape(w.shape)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            values = _unpermute(values, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        new_state[name] = values
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_model.load_state_dict(new_state)
    save_hf_dir(hf_model, hf_path)
    return path, hf_path


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
