"""`LoadConfig`: which model to load and how (its activations' dtype, its weight format), each
declared once as an option (see `specserve.options`) and checked in `__post_init__` with a
`ValueError` naming the field, before anything is read from disk."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specserve.hub.registry import DEFAULT_TARGET, MODELS
from specserve.options import option
from specserve.weights.loader import DTYPES, LoadedModel
from specserve.weights.quant import FORMATS


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """`model` may also be an already `LoadedModel` (Python API), `dtype` a torch dtype."""

    model: str = option(DEFAULT_TARGET, "alias, GGUF file, HF directory or Hugging Face Hub "
                        "id org/repo[:QUANT] (aliases: " + ", ".join(m.alias for m in MODELS)
                        + ")")
    dtype: str = option("auto", "activations' dtype (auto: float32 on the native quantized "
                        "kernels, else bfloat16)", choices=DTYPES)
    weights: str = option("auto", "weight format (auto: a quantized GGUF file stays quantized "
                          "on the native kernels, int4 with its >4-bit tensors at 8 bits; a "
                          "float checkpoint loads bf16; int8/int4 quantize any checkpoint)",
                          choices=FORMATS)

    def __post_init__(self) -> None:
        model = os.fspath(self.model) if isinstance(self.model, os.PathLike) else self.model
        if not isinstance(model, (str, LoadedModel)) or (isinstance(model, str)
                                                         and not model.strip()):
            raise ValueError(f"model must be a model alias, a path or a LoadedModel, "
                             f"got {self.model!r}")
        object.__setattr__(self, "model", model)
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            if dtype not in DTYPES.values():
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        elif not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not isinstance(self.weights, str) or self.weights not in FORMATS:
            raise ValueError(f"weights must be one of {FORMATS}, got {self.weights!r}")
