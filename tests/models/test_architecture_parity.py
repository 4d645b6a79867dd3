"""Llama 3.x (llama3 rope scaling), Mistral, Qwen3 and Gemma 3 against `transformers`, in float32.

Each tiny random model is built here with `transformers`, saved as a Hugging Face directory and
written as a float32 GGUF file (`tests/tiny.py`, llama.cpp's conventions: Llama's Q/K rows
permuted, `rope_freqs` for llama3 scaling, Gemma's norms stored as 1 + w); both load to the
same greedy tokens as `transformers` on the same weights and to logits within `TOL`, on the
native kernels and on the PyTorch path. The prompts are longer than the sliding windows
(gemma3: 4, mistral: 5) and reach the wavelengths llama3 scaling changes.
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specserve import kernels
from specserve.llm import LLM
from specserve.weights.loader import load_model
from tests import tiny
from tests.slots import new_cache as slot_cache

# float32 with other summation orders than PyTorch's (the batch-invariant kernels): logits of
# magnitude ~3 differ in their last bits; the measured worst case is ~4e-6
TOL = 2e-5
PROMPT = [5, 17, 33, 8, 90, 41, 3, 3, 12, 60, 44, 81, 19, 7]
ARCHS = ["llama3", "mistral", "qwen3", "gemma3"]
# gemma3: 6 layers (5 sliding, 1 global, its pattern), tied like the real models; mistral's
# GGUF form has no window (llama.cpp writes none)
BUILD = {"gemma3": {"layers": 6, "tie": True}}
GGUF_BUILD = {"mistral": {"sliding_window": None}}


def native_glue(arch: str, fmt: str) -> bool:
    """Whether the layers' glue runs natively: not for gemma3 or a windowed Mistral model
    (sliding windows, GELU and sandwich norms fall back to the PyTorch path, per model)."""
    return not (arch == "gemma3" or (arch == "mistral" and fmt == "hf"))


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["hf", "gguf"])
def checkpoint(request, arch, tmp_path_factory):
    """(transformers model, path of the same weights as `request.param`)."""
    d = tmp_path_factory.mktemp(f"{arch}-{request.param}")
    if request.param == "hf":
        model = tiny.build_hf_model(arch, **BUILD.get(arch, {}))
        return model, tiny.save_hf_dir(model, d / "hf")
    model = tiny.build_hf_model(arch, **BUILD.get(arch, {}), **GGUF_BUILD.get(arch, {}))
    path, _ = tiny.write_gguf_pair(model, arch, {"default": T.F32}, d / "m.gguf", d / "hf")
    return model, path


@pytest.fixture(params=["native", "pytorch"])
def path_kind(request, monkeypatch) -> str:
    if request.param == "pytorch":
        monkeypatch.setenv("SPECSERVE_NO_NATIVE", "1")
    return request.param


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def reference_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(reference_logits(hf_model, ids)[-1].argmax()))
    return ids[-n:]


def test_prefill_decode_and_verify_match_transformers(checkpoint, path_kind, arch):
    hf_model, path = checkpoint
    model = load_model(path, dtype="float32", weights="float32").model
    native = kernels.attention() is not None and model._native_layers(torch.empty(0))
    assert native == (native_glue(arch, "gguf" if path.suffix == ".gguf" else "hf") and path_kind == "native")
    prefix, draft = PROMPT[:9], PROMPT[9:]  # a verify pass of k + 1 = 5 rows after the prefix
    ref = reference_logits(hf_model, PROMPT)
    cache = slot_cache(model, num_slots=1, max_len=64)
    (got,) = model.forward(cache.batch([prefix[:6]], [0], [0]), cache.pool)
    assert (got - ref[:6]).abs().max() <= TOL
    for pos in range(6, 9):  # decode steps
        (got,) = model.forward(cache.batch([[prefix[pos]]], [pos], [0]), cache.pool)
        assert (got[0] - ref[pos]).abs().max() <= TOL
    (got,) = model.forward(cache.batch([draft], [len(prefix)], [0]), cache.pool)
    assert (got - ref[len(prefix):]).abs().max() <= TOL


def test_greedy_tokens_equal_transformers(checkpoint, path_kind):
    hf_model, path = checkpoint
    loaded = load_model(path, dtype="float32", weights="float32")
    out = LLM(loaded).generate(PROMPT, tiny.greedy(16))[0].outputs[0]
    assert out.token_ids == reference_greedy(hf_model, PROMPT, 16)


def test_llama3_scaling_changes_what_the_test_sees(tmp_path):
    """Without its rope scaling the same weights miss the bound by far: the parity above is a
    test of the scaling, not only of the base rotary embedding."""
    hf_model = tiny.build_hf_model("llama3")
    path = tiny.save_hf_dir(hf_model, tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path, dtype="float32", weights="float32").model
    cache = slot_cache(model, 1, 64)
    (got,) = model.forward(cache.batch([PROMPT], [0], [0]), cache.pool)
    assert (got - reference_logits(hf_model, PROMPT)).abs().max() > 100 * TOL


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_speculation_between_a_same_family_pair_matches_target_only(tmp_path, arch):
    """A draft of the same architecture and vocabulary (another seed), int8 on the native
    kernels: greedy speculative output equals target-only output token for token."""
    kw = BUILD.get(arch, {})
    target = load_model(tiny.save_hf_dir(tiny.build_hf_model(arch, seed=0, **kw), tmp_path / "t"),
                        "float32", weights="int8")
    draft = load_model(tiny.save_hf_dir(tiny.build_hf_model(arch, seed=1, **kw), tmp_path / "d"),
                       "float32", weights="int8")
    plain = LLM(target).generate(PROMPT, tiny.greedy(24))[0].outputs[0]
    fast = LLM(target, draft=draft, speculative_config=tiny.draft_spec(3)).generate(
        PROMPT, tiny.greedy(24))[0].outputs[0]
    same = LLM(target, draft=target, speculative_config=tiny.draft_spec(3)).generate(
        PROMPT, tiny.greedy(24))[0].outputs[0]
    assert fast.token_ids == plain.token_ids == same.token_ids
    assert same.spec.accepted == same.spec.drafted > 0


def test_gemma3_query_scale_is_read_from_the_config(tmp_path):
    """query_pre_attn_scalar other than head_dim (as Gemma 3 27B has) scales the queries."""
    hf_model = tiny.build_hf_model("gemma3", query_pre_attn_scalar=24, **BUILD["gemma3"])
    model = load_model(tiny.save_hf_dir(hf_model, tmp_path / "hf"), "float32", weights="float32").model
    cache = slot_cache(model, 1, 64)
    (got,) = model.forward(cache.batch([PROMPT], [0], [0]), cache.pool)
    assert (got - reference_logits(hf_model, PROMPT)).abs().max() <= TOL
