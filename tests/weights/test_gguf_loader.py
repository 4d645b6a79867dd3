"""GGUF files written in the tests load to the same logits as the same weights from a Hugging
Face directory, in both architectures (llama's Q/K permutation included) and several types."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specserve.weights.gguf_file import LAZY_STRINGS
from specserve.weights.loader import load_model
from tests import tiny
from tests.slots import new_cache as slot_cache

CASES = [
    ("llama", {"default": T.F32}),
    ("qwen2", {"default": T.F16}),
    ("llama", {"default": T.BF16, "embed": T.Q8_0}),
    ("qwen2", {"default": T.Q8_0, "ffn": T.Q4_0}),
    ("llama", {"default": T.Q4_1, "ffn": T.Q5_0, "embed": T.Q5_1}),
    ("qwen2", {"default": T.Q4_K, "ffn": T.Q6_K, "embed": T.Q5_K}),
    ("llama", {"default": T.Q4_K, "attn": T.Q6_K, "embed": T.Q8_0}),
    ("qwen3", {"default": T.Q8_0, "ffn": T.Q4_K}),
    ("gemma3", {"default": T.Q8_0, "ffn": T.Q4_K, "embed": T.Q6_K}),  # heads × 16 < a K block
    ("mistral", {"default": T.Q5_K}),
]


@pytest.mark.parametrize("arch,types", CASES, ids=lambda c: str(c) if isinstance(c, str) else
                         "-".join(f"{k}:{v.name}" for k, v in c.items()))
def test_gguf_loads_to_same_logits_as_hf_directory(tmp_path, arch, types):
    window = {"sliding_window": None} if arch == "mistral" else {}  # llama.cpp writes none
    hf_model = tiny.build_hf_model(arch, hidden_size=256, intermediate_size=512, **window)
    gguf_path, hf_dir = tiny.write_gguf_pair(hf_model, arch, types, tmp_path / "m.gguf", tmp_path / "hf")
    ids = [5, 17, 33, 8, 90, 41, 3, 60]
    from_gguf = load_model(gguf_path, "float32", weights="float32")  # dense, as the HF side
    from_hf = load_model(hf_dir, "float32")
    eps = from_hf.config.rms_norm_eps  # GGUF stores it as float32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=eps) == from_hf.config
    assert from_gguf.config.rms_norm_eps == pytest.approx(eps, rel=1e-6)
    logits = []
    for m in (from_gguf, from_hf):
        cache = slot_cache(m.model, 1, 32)
        logits.append(m.model.forward(cache.batch([ids], [0], [0]), cache.pool)[0])
    assert (logits[0] - logits[1]).abs().max() <= 1e-4
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    # float32 with another summation order than PyTorch's (our batch-invariant matmul): logits
    # of magnitude ~150 differ in their last bits, so the bound is relative
    torch.testing.assert_close(logits[0], ref, rtol=1e-5, atol=1e-4)


def test_gguf_tokenizer_and_template_come_from_the_file(tmp_path):
    hf_model = tiny.build_hf_model("qwen2", hidden_size=256, intermediate_size=512)
    gguf_path, hf_dir = tiny.write_gguf_pair(hf_model, "qwen2", {"default": T.F32}, tmp_path / "m.gguf", tmp_path / "hf")
    m = load_model(gguf_path, "float32")
    assert m.tokenizer.decode(m.tokenizer.encode("the cat")) == "the cat"
    assert m.tokenizer.eos_token_ids == frozenset({2})
    text = m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_pair_with_one_vocabulary_builds_its_tokenizer_once(tmp_path):
    """A vocabulary long enough to be read lazily (`LAZY_STRINGS`) is named by its bytes: a
    second model with the same one (a draft beside its target) reuses the first's tokenizer
    backend; another vocabulary builds its own."""
    vocab = LAZY_STRINGS + 4
    loaded = []
    for i, size in enumerate([vocab, vocab, vocab + 1]):
        hf_model = tiny.build_hf_model("qwen2", seed=i, vocab=size, hidden_size=64,
                                       intermediate_size=128)
        path, _ = tiny.write_gguf_pair(hf_model, "qwen2", {"default": T.F32},
                                       tmp_path / f"m{i}.gguf", tmp_path / f"hf{i}")
        loaded.append(load_model(path, "float32", weights="float32"))
    first, second, other = (m.tokenizer for m in loaded)
    assert second.backend is first.backend and other.backend is not first.backend
    for tok in (first, second, other):
        assert tok.decode(tok.encode("the cat")) == "the cat"
        assert tok.eos_token_ids == frozenset({2}) and tok.special_tokens["eos_token"] == "</s>"
    assert other.vocab_size == first.vocab_size + 1


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    tiny.finish_gguf(w)
    with pytest.raises(ValueError, match="mamba"):
        load_model(tmp_path / "x.gguf", "float32")


def test_corrupt_file_is_refused_clearly(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model(bad, "float32")


def _pair_with(tmp_path, arch, extra):
    hf_model = tiny.build_hf_model(arch)
    path, _ = tiny.write_gguf_pair(hf_model, arch, {"default": T.F32}, tmp_path / "m.gguf",
                                   tmp_path / "hf", extra=extra)
    return path


def test_a_tensor_the_decoder_does_not_implement_is_refused_by_name(tmp_path):
    import numpy as np

    path = _pair_with(tmp_path, "qwen2", lambda w: w.add_tensor(
        "blk.0.attn_sinks.weight", np.zeros(4, dtype=np.float32)))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight.*not implemented"):
        load_model(path, "float32")


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_a_rope_scaling_the_decoder_does_not_implement_is_refused(tmp_path, kind):
    path = _pair_with(tmp_path, "llama", lambda w: w.add_string("llama.rope.scaling.type", kind))
    with pytest.raises(ValueError, match=f"rope scaling '{kind}' is not supported"):
        load_model(path, "float32")


def test_partial_rotary_embedding_is_refused(tmp_path):
    path = _pair_with(tmp_path, "llama", lambda w: w.add_rope_dimension_count(8))
    with pytest.raises(ValueError, match="partial rotary embedding"):
        load_model(path, "float32")


def test_linear_rope_scaling_divides_the_frequencies(tmp_path):
    """A GGUF file's linear scaling gives the same logits as transformers' linear rope_type."""
    hf_model = tiny.build_hf_model("llama", rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    path, _ = tiny.write_gguf_pair(hf_model, "llama", {"default": T.F32}, tmp_path / "m.gguf",
                                   tmp_path / "hf", extra=lambda w: (
                                       w.add_string("llama.rope.scaling.type", "linear"),
                                       w.add_float32("llama.rope.scaling.factor", 4.0)))
    ids = [5, 17, 33, 8, 90, 41, 3, 60]
    for source in (path, tmp_path / "hf"):
        m = load_model(source, "float32", weights="float32")
        assert m.config.rope_scaling.kind == "linear" and m.config.rope_scaling.factor == 4.0
        cache = slot_cache(m.model, 1, 32)
        got = m.model.forward(cache.batch([ids], [0], [0]), cache.pool)[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "llama3"])
def test_quantized_files_of_the_new_architectures_repack_for_the_native_kernels(tmp_path, arch):
    """A Q8_0 file loads int8 on the native kernels (repacked layer by layer, the path real
    files take) within int8's rounding of its dense float32 load."""
    hf_model = tiny.build_hf_model(arch, hidden_size=256, intermediate_size=512)
    path, _ = tiny.write_gguf_pair(hf_model, arch, {"default": T.Q8_0}, tmp_path / "m.gguf",
                                   tmp_path / "hf")
    ids = [5, 17, 33, 8, 90, 41, 3, 60]
    logits = []
    for weights in ("float32", "int8"):
        m = load_model(path, "float32", weights=weights, weight_cache=False)
        assert m.weights == weights
        cache = slot_cache(m.model, 1, 32)
        logits.append(m.model.forward(cache.batch([ids], [0], [0]), cache.pool)[0])
    scale = logits[0].abs().max()
    assert (logits[1] - logits[0]).abs().max() <= 0.05 * scale


def test_rope_freqs_stay_float32_in_a_bfloat16_load(tmp_path):
    hf_model = tiny.build_hf_model("llama3")
    path, _ = tiny.write_gguf_pair(hf_model, "llama3", {"default": T.F32}, tmp_path / "m.gguf",
                                   tmp_path / "hf")
    factors = torch.from_numpy(tiny.llama3_rope_freqs(hf_model.config))
    model = load_model(path, "bfloat16", weights="bf16").model
    assert model.dtype == torch.bfloat16
    expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)) / factors
    assert torch.equal(model._inv_freq, expected)


def test_a_sliding_window_outside_gemma3_is_refused(tmp_path):
    path = _pair_with(tmp_path, "llama", lambda w: w.add_sliding_window(4096))
    with pytest.raises(ValueError, match="sliding-window attention in a llama GGUF file"):
        load_model(path, "float32")
