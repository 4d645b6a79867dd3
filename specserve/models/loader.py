"""Turn a model name (alias, GGUF file or Hugging Face directory) into a ready decoder and its
tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.models import tokenizer as tok
from specserve.models.config import ModelConfig
from specserve.models.gguf_loader import load_gguf, tensor_bits
from specserve.models.quant import FORMATS, quantize_linears
from specserve.models.hf_loader import load_hf_dir
from specserve.models.registry import resolve_model
from specserve.models.transformer import Transformer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    tokenizer: tok.Tokenizer
    config: ModelConfig
    path: Path
    load_seconds: float
    weights: str = "bf16"  # "bf16" (the dtype as loaded) | "int8" | "int4"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(name: str | Path, dtype: str | torch.dtype = "bfloat16",
               weights: str = "bf16") -> LoadedModel:
    """`weights="int8"|"int4"` keeps the projections quantized in memory (bfloat16 activations)."""
    torch_dtype = parse_dtype(dtype)
    if weights not in FORMATS:
        raise ValueError(f"weights must be one of {FORMATS}, got {weights!r}")
    path = resolve_model(str(name))
    start = time.perf_counter()
    if path.is_dir():
        cfg, raw, tensors = load_hf_dir(path, torch_dtype)
        tokenizer = tok.from_hf_dir(path, _eos_ids(path, raw))
    elif path.suffix == ".gguf" or path.is_file():
        cfg, meta, tensors = load_gguf(path, torch_dtype)
        tokenizer = tok.from_gguf_metadata(meta)
    else:
        raise ValueError(f"{path}: neither a GGUF file nor a Hugging Face directory")
    model = Transformer(cfg, tensors)
    del tensors
    bits = tensor_bits(path) if weights != "bf16" and not path.is_dir() else None
    quantize_linears(model, weights, bits)
    return LoadedModel(model, tokenizer, cfg, path, time.perf_counter() - start, weights)


def _eos_ids(path: Path, raw: dict) -> list[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in [raw, json.loads(gen.read_text()) if gen.exists() else {}]:
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return ids
