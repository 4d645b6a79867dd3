"""Load a Hugging Face model directory (`config.json`, `*.safetensors`) of `LlamaForCausalLM`
(and `MistralForCausalLM`, the same decoder), `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
`Gemma3ForCausalLM`, `Qwen3_5ForCausalLM` or `Gemma4ForCausalLM` (the last two: `hybrid_hf.py`).

Gemma 3 and Qwen3.5 norms scale by (1 + w); their weights are stored as 1 + w here (computed
in float32), as llama.cpp's converter stores them in GGUF files, so one RMSNorm serves every
architecture (Qwen3.5's gated norm inside its linear layers scales by w).
A tensor the decoder does not read, or one it needs that is missing, is refused by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specserve.models import hybrid_names
from specserve.models.config import HYBRID_ARCHITECTURES, ModelConfig, arch_traits
from specserve.models.layer import layer_tensor_names
from specserve.weights.hybrid_hf import gemma4_fields, qwen35_fields
from specserve.weights.rope_config import hf_rope

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "Gemma3ForCausalLM": "gemma3", "Qwen3_5ForCausalLM": "qwen35",
                  "Gemma4ForCausalLM": "gemma4"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


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
    field = _FieldReader(file, raw)
    if arch in HYBRID_ARCHITECTURES:
        return _config(file, arch, field, _hybrid_fields), raw
    return _config(file, arch, field, _classic_fields), raw


def _classic_fields(arch: str, field: "_FieldReader", layers: int, hidden: int,
                    head_dim: int) -> dict:
    rope = hf_rope(field.file, field.raw)
    return arch_traits(arch, hidden) | _window(field, arch, layers) | (
        _gemma3(field, rope.local_theta) if arch == "gemma3" else {}) | {
        "rope_theta": field.number("rope_theta", rope.theta), "rope_scaling": rope.scaling}


def _hybrid_fields(arch: str, field: "_FieldReader", layers: int, hidden: int,
                   head_dim: int) -> dict:
    own = qwen35_fields(field, layers, head_dim) if arch == "qwen35" \
        else gemma4_fields(field, layers)
    return arch_traits(arch, hidden) | own


def _config(file: Path, arch: str, field: "_FieldReader", arch_fields) -> ModelConfig:
    """The fields every decoder has, then `arch_fields(arch, field, layers, hidden,
    head_dim)`'s (which override them)."""
    raw = field.raw
    heads = field.int("num_attention_heads")
    hidden = field.int("hidden_size")
    if "head_dim" not in raw and hidden % heads:
        raise ValueError(f"{file}: hidden_size ({hidden}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")
    layers = field.int("num_hidden_layers")
    head_dim = field.int("head_dim", hidden // heads)
    fields = dict(
        architecture=arch,
        vocab_size=field.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=field.int("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=field.int("num_key_value_heads", heads),
        head_dim=head_dim,
        rope_theta=10000.0,
        rms_norm_eps=field.number("rms_norm_eps"),
        max_position=field.int("max_position_embeddings", 4096),
        tie_word_embeddings=field.bool("tie_word_embeddings", arch == "gemma3"),
        attention_bias=arch == "qwen2" or field.bool("attention_bias", False),
    ) | arch_fields(arch, field, layers, hidden, head_dim)
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # cross-field rules (e.g. kv heads dividing heads)
        raise ValueError(f"{file}: {e}") from None


def _window(field: "_FieldReader", arch: str, layers: int) -> dict:
    """`sliding_window` and `sliding_layers`: from `layer_types` where the file has it, else by
    the architecture's own rule (Mistral: every layer when `sliding_window` is set; Qwen:
    layers from `max_window_layers` on when `use_sliding_window`; Gemma 3: all but every
    `sliding_window_pattern`-th)."""
    types = field.raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers \
                or any(t not in _LAYER_TYPES for t in types):
            raise ValueError(f"{field.file}: field 'layer_types' must list {layers} of "
                             f"{', '.join(_LAYER_TYPES)}, got {types!r}")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif arch == "gemma3":
        pattern = field.int("sliding_window_pattern", 6)
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    elif arch in ("qwen2", "qwen3"):
        sliding = tuple(range(field.int("max_window_layers", layers), layers)) \
            if field.bool("use_sliding_window", False) else ()
    else:
        sliding = tuple(range(layers)) if field.raw.get("sliding_window") is not None else ()
    if not sliding:
        return {}
    return {"sliding_window": field.int("sliding_window"), "sliding_layers": sliding}


def _gemma3(field: "_FieldReader", local_theta: float | None) -> dict:
    if field.raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{field.file}: attention logit soft-capping is not supported")
    if field.bool("use_bidirectional_attention", False):
        raise ValueError(f"{field.file}: bidirectional attention is not supported")
    act = field.raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{field.file}: field 'hidden_activation' {act!r} is not supported; "
                         f"supported: gelu_pytorch_tanh")
    cap = field.raw.get("final_logit_softcapping")
    return {"attn_scale": 1 / math.sqrt(field.number("query_pre_attn_scalar")),
            "rope_local_theta": field.number("rope_local_base_freq", local_theta or 10000.0),
            "final_logit_softcap": None if cap is None
            else field.number("final_logit_softcapping")}


def check_tensor_names(cfg: ModelConfig, names: set[str], where: Path) -> None:
    """Refuse a checkpoint that lacks a tensor `cfg` needs or holds one the decoder does not
    read (rather than dropping it); `rotary_emb.inv_freq` buffers are derived, so allowed."""
    if cfg.architecture in HYBRID_ARCHITECTURES:
        needed = hybrid_names.tensor_names(cfg)
    else:
        needed = {"model.embed_tokens.weight", "model.norm.weight"} | {
            f"model.layers.{i}.{n}" for i in range(cfg.num_layers)
            for n in layer_tensor_names(cfg)}
    missing = sorted(needed - names)
    if missing:
        raise ValueError(f"{where}: missing tensors {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(n for n in names - needed - {"lm_head.weight"}
                     if not n.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"{where}: tensors {unknown[:5]} are not implemented by the "
                         f"{cfg.architecture} decoder")


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
                    weights[name] = _read(f, name, cfg, dtype)
        except SafetensorError as e:
            raise ValueError(f"{file}: corrupt or unreadable safetensors file ({e})") from None
    if cfg.mtp_layers and not any(n.startswith("mtp.") for n in weights):
        cfg = replace(cfg, mtp_layers=0)  # saved without its multi-token-prediction head
    check_tensor_names(cfg, set(weights), path)
    return cfg, raw, weights


def one_plus_norm(arch: str, name: str) -> bool:
    """Whether checkpoint tensor `name` is an RMSNorm weight w applied as (1 + w)."""
    if arch == "gemma3":
        return name.endswith("norm.weight")
    return arch == "qwen35" and name.endswith(
        ("norm.weight", "norm_embedding.weight", "norm_hidden.weight")) \
        and not name.endswith("linear_attn.norm.weight")


def _read(f, name: str, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    t = f.get_tensor(name)
    if one_plus_norm(cfg.architecture, name):
        t = t.float() + 1.0  # (1 + w), as the reference RMSNorm computes it in float32
    return t.to(dtype)
