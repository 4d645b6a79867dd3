"""Rotary position embedding frequencies: the base formula and the scalings the decoder implements.

`inv_freq` gives the per-pair inverse frequencies θ_i = base^(-2i/d) of Su et al. 2104.09864,
then applies a scaling:
- "linear" (position interpolation, Chen et al. 2306.15595): every θ_i divided by `factor`;
- "llama3" (Llama 3.1): wavelengths above `original_max_position / low_freq_factor` divided by
  `factor`, below `original_max_position / high_freq_factor` kept, and those between blended
  smoothly, as Meta's reference code and Hugging Face's `_compute_llama3_parameters` do;
- per-pair factors read from a file (GGUF's `rope_freqs` tensor, which llama.cpp's converter
  writes for "llama3" scaling): θ_i divided by factor_i.
Any other scaling is refused where the configuration is read (`RopeScaling.__post_init__`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A frequency scaling of the rotary embedding (see the module docstring)."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported; "
                             f"supported: {', '.join(ROPE_SCALINGS)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"rope scaling {name} must be a positive number, got {value!r}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope scaling high_freq_factor ({self.high_freq_factor}) must "
                             f"exceed low_freq_factor ({self.low_freq_factor})")
        value = self.original_max_position
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rope scaling original_max_position must be a positive integer, "
                             f"got {value!r}")


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 inverse frequencies `[head_dim / 2]` for rotary base `theta`."""
    base = 1.0 / (theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [hd / 2]
    if freq_factors is not None:
        if freq_factors.shape != base.shape:
            raise ValueError(f"rope_freqs: expected {list(base.shape)} factors (head_dim / 2), "
                             f"got {list(freq_factors.shape)}")
        base = base / freq_factors.float()
    if scaling is None:
        return base
    if scaling.kind == "linear":
        return base / scaling.factor
    return _llama3(base, scaling)


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling, in the order of operations of Hugging Face's implementation."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / base  # [hd / 2]
    scaled = torch.where(wavelen > low_freq_wavelen, base / s.factor, base)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) \
        / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
