"""A quantized model's projections as float weights, read again from its source file on demand:
what the prefill path's dense copies are made from (`models/prefill.py`), independent of the
repacked int4 layout the kernels run.

A GGUF file's tensors go through the same dequantization the loader reads every tensor with
(`weights/dequant.py`, equal to the `gguf` package's `gguf.quants.dequantize` bit for bit,
llama's Q/K rows unpermuted); a Hugging Face directory's are its safetensors tensors as
stored. Nothing is read until a projection is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from specserve.models.config import ModelConfig
from specserve.weights.gguf_file import GGUFFile
from specserve.weights.gguf_loader import read_tensor, tensor_index
from specserve.weights.quant import layer_projections


class DenseSource:
    """`source(layer, attr)` → the float32 weights `[out, in]` of projection `attr` ("qkv",
    "o", "gate_up", "down") of layer `layer`: its checkpoint tensors stacked as `Layer`
    stacks them (q, k, v; gate, up)."""

    def __init__(self, read: Callable[[str], torch.Tensor]) -> None:
        self._read = read  # Hugging Face tensor name → float32 tensor

    def __call__(self, layer: int, attr: str) -> torch.Tensor:
        names = layer_projections(layer)[attr]
        return torch.cat([self._read(name) for name in names])


def gguf_source(gguf_file: GGUFFile, cfg: ModelConfig) -> DenseSource:
    index = tensor_index(gguf_file)
    return DenseSource(lambda name: read_tensor(gguf_file, cfg, index[name], torch.float32))


def hf_source(path: Path) -> DenseSource:
    where = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    return DenseSource(read)
