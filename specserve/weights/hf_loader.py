"""Load a Hugging Face model directory (`config.json`, `*.safetensors`) of `LlamaForCausalLM`
or `Qwen2ForCausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specserve.models.config import ModelConfig

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    """Parse `config.json`; a missing or malformed field raises ValueError naming the file and
    the field."""
    file = path / "config.json"
    if not file.exists():
        raise ValueError(f"{path}: no config.json (expected a Hugging Face model directory)")
    raw = _read_json(file)
    archs = raw.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None) \
        if isinstance(archs, list) and all(isinstance(a, str) for a in archs) else None
    if arch is None:
        raise ValueError(f"{file}: architectures {archs!r} not supported; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    scaling = raw.get("rope_scaling") or (_optional_dict(file, raw, "rope_parameters")).get("rope_type")
    if isinstance(scaling, dict):
        scaling = scaling.get("rope_type", scaling.get("type"))
    if scaling not in (None, "default"):
        raise ValueError(f"{file}: rope scaling {scaling!r} is not supported")
    rope_theta = raw.get("rope_theta", _optional_dict(file, raw, "rope_parameters").get("rope_theta", 10000.0))
    field = _FieldReader(file, raw)
    heads = field.int("num_attention_heads")
    hidden = field.int("hidden_size")
    if "head_dim" not in raw and hidden % heads:
        raise ValueError(f"{file}: hidden_size ({hidden}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")
    try:
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=field.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=field.int("intermediate_size"),
            num_layers=field.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=field.int("num_key_value_heads", heads),
            head_dim=field.int("head_dim", hidden // heads),
            rope_theta=field.number("rope_theta", rope_theta),
            rms_norm_eps=field.number("rms_norm_eps"),
            max_position=field.int("max_position_embeddings", 4096),
            tie_word_embeddings=field.bool("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or field.bool("attention_bias", False),
        )
    except ValueError as e:  # cross-field rules (e.g. kv heads dividing heads)
        raise ValueError(f"{file}: {e}") from None
    return cfg, raw


def _read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(raw).__name__}")
    return raw


def _optional_dict(file: Path, raw: dict, name: str) -> dict:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{file}: field {name!r} must be an object, got {value!r}")
    return value


class _FieldReader:
    """Typed access to `config.json` fields; errors name the file and the field. A field that
    is absent or null takes `default`; without a default it is required."""

    _REQUIRED = object()

    def __init__(self, file: Path, raw: dict) -> None:
        self.file, self.raw = file, raw

    def _get(self, name: str, default: object) -> object:
        value = self.raw.get(name)
        if value is None:
            if default is self._REQUIRED:
                raise ValueError(f"{self.file}: missing field {name!r}")
            return default
        return value

    def int(self, name: str, default: object = _REQUIRED) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{self.file}: field {name!r} must be a positive integer, got {value!r}")
        return value

    def number(self, name: str, default: object = _REQUIRED) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value < float("inf"):
            raise ValueError(f"{self.file}: field {name!r} must be a positive number, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.file}: field {name!r} must be true or false, got {value!r}")
        return value


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    cfg, raw = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    weights = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name).to(dtype)
        except SafetensorError as e:
            raise ValueError(f"{file}: corrupt or unreadable safetensors file ({e})") from None
    return cfg, raw, weights
