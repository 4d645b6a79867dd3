"""Qwen3.5 and Gemma 4 (text) against `transformers`, in float32, from Hugging Face directories
and from GGUF files written as llama.cpp's converter writes them (`tests/hybrid_tiny.py`).

The tiny Qwen3.5 mixes Gated DeltaNet and gated full-attention layers, with two value heads per
key head (so the GGUF value-head reordering is exercised); the tiny Gemma 4 has per-layer
inputs, two KV-sharing layers, global layers of their own head size with keys reused as values,
double-wide MLPs and a sliding window shorter than the prompt; "gemma4-plain" has none of those.
"""

from __future__ import annotations

import json

import pytest
import torch

from specserve.llm import LLM
from specserve.models.transformer import ForwardBatch
from specserve.weights.loader import load_model
from tests import hybrid_tiny, tiny

# transformers' own float32 logits differ from its float64 ones by up to 3e-5 on these models
# (its chunked DeltaNet prefill and its step-by-step decode by 1.7e-5); ours from float64 by up
# to 2.6e-5: a bound of a few times that, on logits of magnitude ~3
TOL = 1e-4
PROMPT = [5, 17, 33, 8, 90, 41, 3, 3, 12, 60, 44, 81, 19, 7]
KINDS = ["qwen35", "gemma4", "gemma4-plain"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_model(kind):
    return hybrid_tiny.build(kind)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def path(request, kind, hf_model, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"{kind}-{request.param}")
    if request.param == "hf":
        return hybrid_tiny.save(hf_model, d / "hf")
    return hybrid_tiny.write_gguf(hf_model, kind, d / "m.gguf")


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def batch(rows, start, key="seq", blocks=4):
    return ForwardBatch.paged([rows], [start], [list(range(blocks))], [key])


def test_prefill_decode_and_verify_match_transformers(hf_model, path):
    model = load_model(path, dtype="float32", weights="float32").model
    ref = reference_logits(hf_model, PROMPT)
    pool = model.new_pool(8, 16)
    (got,) = model.forward(batch(PROMPT[:6], 0), pool)
    assert (got - ref[:6]).abs().max() <= TOL
    for pos in range(6, 9):  # decode steps
        (got,) = model.forward(batch([PROMPT[pos]], pos), pool)
        assert (got[0] - ref[pos]).abs().max() <= TOL
    (got,) = model.forward(batch(PROMPT[9:], 9), pool)  # a verify pass of k + 1 = 5 rows
    assert (got - ref[9:]).abs().max() <= TOL


def test_greedy_tokens_equal_transformers(hf_model, path):
    loaded = load_model(path, dtype="float32", weights="float32")
    out = LLM(loaded, speculative_config=None).generate(PROMPT, tiny.greedy(12))[0].outputs[0]
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(reference_logits(hf_model, ids)[-1].argmax()))
    assert out.token_ids == ids[len(PROMPT):]


def test_ragged_batch_of_two_sequences_equals_each_alone(hf_model, path):
    """Two sequences in one pass (a 3-row verify beside a 1-row decode), recurrent state and
    KV pools kept apart: the same logits as each sequence's own reference."""
    model = load_model(path, dtype="float32", weights="float32").model
    a, b = PROMPT, PROMPT[::-1]
    pool = model.new_pool(8, 16)
    model.forward(ForwardBatch.paged([a[:8], b[:5]], [0, 0], [[0, 1], [2, 3]], ["a", "b"]),
                  pool)
    got_a, got_b = model.forward(
        ForwardBatch.paged([a[8:11], b[5:6]], [8, 5], [[0, 1], [2, 3]], ["a", "b"]), pool)
    assert (got_a - reference_logits(hf_model, a[:11])[8:]).abs().max() <= TOL
    assert (got_b - reference_logits(hf_model, b[:6])[5:]).abs().max() <= TOL


def _edit_config(tmp_path, kind, **changes):
    path = hybrid_tiny.save(hybrid_tiny.build(kind), tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))
    return path


@pytest.mark.parametrize("kind, change, message", [
    ("qwen35", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope scaling 'yarn'"),
    ("qwen35", {"attention_bias": True}, "attention_bias"),
    ("gemma4", {"enable_moe_block": True}, "enable_moe_block"),
    ("gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ("gemma4", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope scaling 'yarn' of the full-attention layers"),
])
def test_unimplemented_options_are_refused_by_name(tmp_path, kind, change, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edit_config(tmp_path, kind, **change), "float32", weights="float32")


def test_a_tensor_the_decoder_does_not_read_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = hybrid_tiny.save(hybrid_tiny.build("qwen35"), tmp_path / "hf")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(4, 4)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="in_proj_qkvz.*not implemented by the qwen35"):
        load_model(path, "float32", weights="float32")


def test_quantized_formats_are_refused_for_the_hybrid_decoders(tmp_path):
    path = hybrid_tiny.save(hybrid_tiny.build("gemma4"), tmp_path / "hf")
    with pytest.raises(ValueError, match="weights='int8' is not supported for gemma4"):
        load_model(path, "float32", weights="int8")


def test_a_gguf_tensor_the_decoder_does_not_read_is_refused(tmp_path):
    """Gemma 4's mixture-of-experts router, written as llama.cpp names it."""
    import numpy as np

    def moe(writer):
        writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 64), dtype=np.float32))

    path = hybrid_tiny.write_gguf(hybrid_tiny.build("gemma4"), "gemma4", tmp_path / "m.gguf",
                                  extra=moe)
    with pytest.raises(ValueError, match="ffn_gate_inp.*not implemented by the gemma4"):
        load_model(path, "float32", weights="float32")
