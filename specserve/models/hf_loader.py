"""Load a Hugging Face model directory (`config.json`, `*.safetensors`) of `LlamaForCausalLM`
or `Qwen2ForCausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.models.config import ModelConfig

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    file = path / "config.json"
    if not file.exists():
        raise ValueError(f"{path}: no config.json (expected a Hugging Face model directory)")
    raw = json.loads(file.read_text())
    archs = raw.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path}: architectures {archs} not supported; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {}).get("rope_type")
    if isinstance(scaling, dict):
        scaling = scaling.get("rope_type", scaling.get("type"))
    if scaling not in (None, "default"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported")
    rope_theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = raw["num_attention_heads"]
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=raw["rms_norm_eps"],
        max_position=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
    )
    return cfg, raw


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    cfg, raw = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype)
    return cfg, raw, weights
