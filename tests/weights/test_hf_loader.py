"""Tests for reading a Hugging Face `config.json`: a malformed file names the file and the
missing or bad field instead of raising KeyError deep in the loader."""

from __future__ import annotations

import json

import pytest

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
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must hold a JSON object"),
]


@pytest.mark.parametrize(("config", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_malformed_config_names_the_file_and_field(tmp_path, config, message):
    write_config(tmp_path, config)
    with pytest.raises(ValueError, match=message) as error:
        read_config(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)


def test_good_config_reads_every_field(tmp_path):
    write_config(tmp_path, GOOD | {"num_key_value_heads": None})  # null: defaults to the heads
    config, raw = read_config(tmp_path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 16)
    assert config.architecture == "qwen2" and config.rope_theta == 1e6 and raw["vocab_size"] == 112
