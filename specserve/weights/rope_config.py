"""The rotary embedding's settings as checkpoints state them: `config.json` and GGUF metadata.

Hugging Face configs give them two ways: `rope_theta` and `rope_scaling` at the top level
(transformers 4), or a `rope_parameters` object (transformers 5), which Gemma 3 keys by layer
type (`full_attention`, `sliding_attention`). GGUF files give the base (`{arch}.rope.freq_base`)
and a scaling type (`{arch}.rope.scaling.type`, `.factor`); Llama 3.x files carry "llama3"
scaling as a `rope_freqs` tensor instead, which the decoder reads with the weights. A scaling
this decoder does not implement (`rope.py`) is refused, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.models.rope import RopeScaling

_PLAIN = (None, "default", "none")


@dataclass(frozen=True, slots=True)
class RopeSettings:
    theta: float  # base of the full-attention layers
    scaling: RopeScaling | None  # of the full-attention layers
    local_theta: float | None  # base of the sliding-window layers (Gemma 3); None: theta


def hf_rope(file: Path, raw: dict) -> RopeSettings:
    """The settings of a `config.json` (`raw`); a bad or unimplemented one raises ValueError
    naming the file."""
    params = raw.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"{file}: field 'rope_parameters' must be an object, got {params!r}")
    per_type = "full_attention" in params or "sliding_attention" in params
    full = (params.get("full_attention") or {}) if per_type else params
    local = (params.get("sliding_attention") or {}) if per_type else {}
    scaling = raw.get("rope_scaling") or full
    if isinstance(scaling, str):
        scaling = {"rope_type": scaling}
    if not isinstance(scaling, dict) or not isinstance(full, dict) or not isinstance(local, dict):
        raise ValueError(f"{file}: rope scaling must be an object, got {scaling!r}")
    if local.get("rope_type", local.get("type")) not in _PLAIN:
        raise ValueError(f"{file}: rope scaling {local.get('rope_type')!r} of the sliding "
                         f"layers is not supported")
    theta = raw.get("rope_theta", full.get("rope_theta", 10000.0))
    local_theta = raw.get("rope_local_base_freq", local.get("rope_theta"))
    try:
        return RopeSettings(theta, _hf_scaling(scaling), local_theta)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def _hf_scaling(d: dict) -> RopeScaling | None:
    kind = d.get("rope_type", d.get("type"))
    if kind in _PLAIN:
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: linear, llama3")
    missing = [k for k in ("factor",) + (("low_freq_factor", "high_freq_factor",
                                          "original_max_position_embeddings")
                                         if kind == "llama3" else ()) if d.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} lacks {', '.join(missing)}")
    if kind == "linear":
        return RopeScaling("linear", d["factor"])
    return RopeScaling("llama3", d["factor"], d["low_freq_factor"], d["high_freq_factor"],
                       d["original_max_position_embeddings"])


def gguf_rope(meta: dict, arch: str, head_dim: int, path: Path) -> RopeSettings:
    """The settings of a GGUF file's metadata (`rope_freqs`, if any, is read as a tensor)."""
    dims = meta.get(f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        raise ValueError(f"{path}: rope over {dims} of {head_dim} head dimensions (partial "
                         f"rotary embedding) is not supported")
    kind = meta.get(f"{arch}.rope.scaling.type")
    scaling = None
    if kind == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.rope.scaling.factor")
        try:
            scaling = RopeScaling("linear", float(factor))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    elif kind not in _PLAIN:
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported; supported: linear, "
                         f"llama3 (as a rope_freqs tensor)")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    # llama.cpp fixes Gemma 3's sliding layers at base 10000, unscaled
    return RopeSettings(theta, scaling, 10000.0 if arch == "gemma3" else None)
