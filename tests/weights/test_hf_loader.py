"""Tests for reading a Hugging Face `config.json`: a malformed file names the file and the
missing or bad field instead of raising KeyError deep in the loader."""

from __future__ import annotations

import json

import pytest

from specserve.models.rope import RopeScaling
from specserve.weights.hf_loader import read_config

GOOD = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 112, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


def write_config(tmp_path, config) -> None:
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))


def without(name: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != name}


BAD = [
    (without("num_attention_heads"), "missing field 'num_attention_heads'"),
    (without("vocab_size"), "missing field 'vocab_size'"),
    (without("rms_norm_eps"), "missing field 'rms_norm_eps'"),
    (GOOD | {"hidden_size": "64"}, "field 'hidden_size' must be a positive integer, got '64'"),
    (GOOD | {"num_hidden_layers": 0}, "field 'num_hidden_layers' must be a positive integer"),
    (GOOD | {"num_attention_heads": 4.0}, "field 'num_attention_heads' must be a positive integer"),
    (GOOD | {"num_key_value_heads": 3}, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    (GOOD | {"hidden_size": 66}, r"hidden_size \(66\) must be a multiple of num_attention_heads"),
    (GOOD | {"rms_norm_eps": "tiny"}, "field 'rms_norm_eps' must be a positive number"),
    (GOOD | {"tie_word_embeddings": "yes"}, "field 'tie_word_embeddings' must be true or false"),
    (GOOD | {"architectures": "Qwen2ForCausalLM"}, "architectures 'Qwen2ForCausalLM' not supported"),
    (GOOD | {"architectures": ["GPT2LMHeadModel"]}, "not supported"),
    (GOOD | {"rope_parameters": 3}, "field 'rope_parameters' must be an object"),
    (GOOD | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
    (GOOD | {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not supported"),
    (GOOD | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope scaling 'longrope'"),
    (GOOD | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}},
     "rope scaling 'llama3' lacks low_freq_factor"),
    (GOOD | {"rope_scaling": {"rope_type": "linear", "factor": -1}}, "factor must be a positive number"),
    (GOOD | {"layer_types": ["full_attention", "chunked_attention"]}, "field 'layer_types' must list 2"),
    (GOOD | {"architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": 16,
             "sliding_window": 4, "attn_logit_softcapping": 50.0}, "attention logit soft-capping is not supported"),
    (GOOD | {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 4},
     "missing field 'query_pre_attn_scalar'"),
    (GOOD | {"architectures": ["Gemma3ForCausalLM"]}, "missing field 'sliding_window'"),
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must hold a JSON object"),
]


@pytest.mark.parametrize(("config", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_malformed_config_names_the_file_and_field(tmp_path, config, message):
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match=message) as error:
        read_config(tmp_path)
    assert str(error.value).count(str(tmp_path / "config.json")) == 1


def test_good_config_reads_every_field(tmp_path):
    write_config(tmp_path, GOOD | {"num_key_value_heads": None})  # null: defaults to the heads
    config, raw = read_config(tmp_path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 16)
    assert config.architecture == "qwen2" and config.rope_theta == 1e6 and raw["vocab_size"] == 112


def test_good_llama3_config_reads_its_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    write_config(tmp_path, GOOD | {"architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                                   "rope_scaling": scaling})
    config, _ = read_config(tmp_path)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


def test_a_tensor_the_decoder_does_not_read_is_refused_by_name(tmp_path):
    import torch
    from safetensors.torch import save_file

    from specserve.weights.loader import load_model
    from tests import tiny

    path = tiny.save_hf_dir(tiny.build_hf_model("llama"), tmp_path / "hf")
    save_file({"model.layers.0.mlp.experts.weight": torch.zeros(2, 2)}, str(path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.weight.*not implemented"):
        load_model(path, "float32")
