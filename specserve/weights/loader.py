"""Turn a model name (alias, GGUF file, Hugging Face directory or Hub id `org/repo[:QUANT]`,
see `hub/resolver.py`) into a ready decoder and its tokenizer.

`weights="auto"` (the default) follows the source: a GGUF file whose projections are stored
quantized stays quantized on the native kernels as "int4": every quantized tensor as the
file's own blocks (`file_blocks.py`: its codes and scales repacked, never quantized again on
a new grid; its float tensors at 8 bits); a float GGUF file or a Hugging Face directory loads
dense, in bfloat16 (float32 when `dtype` says so). The load line (`LoadedModel.carried`) says
how each type was carried. Where the native kernels cannot run, "auto" loads dense bfloat16. `dtype="auto"`
follows the weights: float32 for the native kernels (their activations are float32; the
embedding and norms are kept in float32 too), bfloat16 for dense weights.

A draft model (`draft=True`) that would load int4 loads "int4-all" instead: every projection
and the head at 4 bits, the wider tensors quantized anew (the 0.5B Qwen2.5-Coder Q4_K_M file
stores its gate/up, output and q/k projections Q5_0, its head Q8_0; its Q4_K tensors stay
the file's own). A draft's precision
changes only how often its drafts are accepted, never the output (the verifier judges each
draft against the distribution it was sampled from). The default pair's draft step reads
257 MB instead of 364 (restricted head included), and acceptance on the shipped workloads
stayed level.

A GGUF file on the native kernels is repacked once, layer by layer straight from its memory
map (the float weights of one layer at a time, never the whole model), and the result is
kept in the weight cache (`weight_cache.py`); later loads map it from there in well under a
second.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve import kernels
from specserve.weights import dequant, file_blocks
from specserve.models import tokenizer as tok
from specserve.weights import weight_cache
from specserve.weights.dense_source import gguf_source, hf_source
from specserve.models.config import HYBRID_ARCHITECTURES, ModelConfig
from specserve.models.factory import build_model
from specserve.weights.gguf_file import GGUFFile, GGUFTensor
from specserve.weights.gguf_loader import (config_from_gguf, hf_name, is_quantized, open_gguf,
                                          read_metadata, read_tensor, tensor_bits, tensor_index,
                                          unpermute)
from specserve.weights.hf_loader import load_hf_dir, read_config
from specserve.weights.file_blocks import KIND_NAMES, carries, concat, native_blocks
from specserve.weights.quant import (FORMATS, FOUR_BIT_SOURCE_MAX, KIND_R8, LANES, NATIVE_LAYOUT_VERSION,
                                    SIX_BIT_SOURCE_MAX,
                                    QUANTIZED_FORMATS, NativeLinear, NativeWeights, Part,
                                    head_source, layer_projections,
                                    native_weights_from_tensors, native_weights_to_tensors,
                                    projection_width, quantize_layer, quantize_linear,
                                    quantize_linears, quantize_native, super_block)
from specserve.paths import weights_dir
from specserve.hub.resolver import resolve_model
from specserve.models.transformer import Layer, Transformer

log = logging.getLogger(__name__)

# "auto" (None): follow the weights (see the module docstring).
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16}
_DENSE_NAMES = {torch.bfloat16: "bf16", torch.float32: "float32", torch.float16: "float16"}
# The code whose output the weight cache stores (besides NATIVE_LAYOUT_VERSION, which the
# kernels' owner bumps): an edit to any of these rebuilds the entries.
_CACHED_CODE = (dequant, file_blocks, unpermute, read_tensor, NativeWeights, quantize_native,
                NativeLinear.__init__, projection_width, quantize_linear, quantize_layer, Layer)
# quantized types already at 4 bits: int4-all carries them as they are
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    tokenizer: tok.Tokenizer
    config: ModelConfig
    path: Path
    load_seconds: float
    weights: str = "bf16"  # as loaded: "bf16" | "float32" | "float16" (dense) | "int8" | "int4"
    # | "int4-all"
    cache_hit: bool = False  # the repacked weights were mapped from the weight cache
    # how the file's tensors reach the kernels (native GGUF loads): e.g. "the file's own
    # blocks: Q4_K 4-bit ×169, Q6_K 6-bit, scales per 16 ×29"
    carried: str = ""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype, or None for "auto"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_format(weights: str, quantized_source: bool, native: bool, draft: bool = False
                   ) -> str:
    """What `weights` means for a source: "auto" → "int4" for a quantized file on the native
    kernels, else "bf16" (dense); for a `draft`, int4 becomes "int4-all"."""
    fmt = weights if weights != "auto" else "int4" if quantized_source and native else "bf16"
    return "int4-all" if draft and fmt == "int4" else fmt


def resolve_dtype(dtype: torch.dtype | None, fmt: str, native: bool) -> torch.dtype:
    """The dtype the tensors are read into (see the module docstring)."""
    if fmt == "float32":
        return torch.float32
    if dtype is not None:
        return dtype
    return torch.float32 if fmt in QUANTIZED_FORMATS and native else torch.bfloat16


def load_model(name: str | Path, dtype: str | torch.dtype = "auto", weights: str = "auto",
               weight_cache: bool = True, draft: bool = False) -> LoadedModel:
    """`weights`: one of `FORMATS` (see the module docstring); `weight_cache=False` repacks
    without reading or writing the weight cache; `draft`: load a draft model (what `weights`
    resolves to int4 loads int4-all)."""
    if weights not in FORMATS:
        raise ValueError(f"weights must be one of {FORMATS}, got {weights!r}")
    requested = parse_dtype(dtype)
    if weights == "float32" and requested not in (None, torch.float32):
        raise ValueError(f"weights='float32' loads float32; dtype must be 'auto' or 'float32', "
                         f"got {dtype!r}")
    path = resolve_model(str(name))
    start = time.perf_counter()
    native = kernels.qmatmul() is not None
    hit, carried = False, ""
    if path.is_dir():
        cfg, _ = read_config(path)
        fmt = _hybrid_format(cfg, weights) or resolve_format(weights, False, native, draft)
        torch_dtype = resolve_dtype(requested, fmt, native)
        cfg, raw, tensors = load_hf_dir(path, torch_dtype)
        tokenizer = tok.from_hf_dir(path, eos_ids(path, raw))
        model = build_model(cfg, tensors)
        del tensors
        quantize_linears(model, fmt)
        if fmt in QUANTIZED_FORMATS:  # the prefill path's dense copies come from the file
            model.dense_weights = hf_source(path)
    elif path.suffix == ".gguf" or path.is_file():
        gguf_file = open_gguf(path)
        meta = read_metadata(gguf_file)
        cfg = config_from_gguf(gguf_file, meta)
        bits = tensor_bits(gguf_file)
        fmt = _hybrid_format(cfg, weights) \
            or resolve_format(weights, is_quantized(bits), native, draft)
        torch_dtype = resolve_dtype(requested, fmt, native)
        if fmt in QUANTIZED_FORMATS and native and _fits_native(gguf_file, fmt):
            slot = _cache_slot(path, fmt, torch_dtype) if weight_cache else None
            # The entry's checks (memory-bound, outside the GIL) overlap the tokenizer's build.
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(_read_entry, slot)
                tokenizer = tok.from_gguf_metadata(meta)
                entry = pending.result()
            model, hit, carried = _load_native(gguf_file, cfg, bits, fmt, torch_dtype, slot,
                                               entry)
            model.dense_weights = gguf_source(gguf_file, cfg)  # the prefill path's source
        else:
            tokenizer = tok.from_gguf_metadata(meta)
            index = tensor_index(gguf_file)
            model = build_model(cfg, {n: read_tensor(gguf_file, cfg, t, torch_dtype)
                                      for n, t in index.items()})
            quantize_linears(model, fmt, bits)
    else:
        raise ValueError(f"{path}: neither a GGUF file nor a Hugging Face directory")
    label = fmt if fmt in QUANTIZED_FORMATS else _DENSE_NAMES.get(model.dtype, "bf16")
    if carried:
        log.info("%s: %s weights, %s", path.name, label, carried)
    return LoadedModel(model, tokenizer, cfg, path, time.perf_counter() - start, label, hit,
                       carried)


def _hybrid_format(cfg: ModelConfig, weights: str) -> str | None:
    """The format of a hybrid decoder (Qwen3.5, Gemma 4), which loads dense for now ("auto":
    bfloat16, "float32" where asked); None for the other architectures."""
    if cfg.architecture not in HYBRID_ARCHITECTURES:
        return None
    if weights in QUANTIZED_FORMATS:
        raise ValueError(f"weights={weights!r} is not supported for {cfg.architecture} models "
                         f"yet; use 'auto', 'bf16' or 'float32'")
    return "bf16" if weights == "auto" else weights


def _fits_native(gguf_file: GGUFFile, fmt: str) -> bool:
    """Whether every projection suits the native kernels: the file's own blocks do (blocks of
    32), what is quantized anew needs an input width of super-blocks of 64 (`_part`)."""
    return all(_own_blocks(fmt, t.qtype) or super_block(t.shape[-1]) is not None
               for n, t in tensor_index(gguf_file).items() if _is_projection(n)
               and n.endswith(".weight"))


def eos_ids(path: Path, raw: dict) -> list[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in [raw, json.loads(gen.read_text()) if gen.exists() else {}]:
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return ids


# ------------------------------------------------------------------ native, with the weight cache
def _is_projection(name: str) -> bool:
    """Tensors that end up inside a quantized layer (weights, and the q/k/v biases)."""
    return name.endswith(("_proj.weight", "_proj.bias")) or name == "lm_head.weight"


def _cache_slot(source: Path, fmt: str, dtype: torch.dtype) -> tuple[Path, dict]:
    """(entry file, key) of the weight cache for `source` repacked as `fmt` in `dtype`."""
    directory = weights_dir()
    key = _cache_key(source, directory, fmt, dtype)
    label = f"{fmt}-{str(dtype).removeprefix('torch.')}"
    return weight_cache.entry_path(directory, source, label, key), key


def _read_entry(slot: tuple[Path, dict] | None) -> weight_cache.CacheEntry | None:
    return weight_cache.read(*slot) if slot is not None else None


def _load_native(gguf_file: GGUFFile, cfg: ModelConfig, bits: dict[str, float], fmt: str,
                 dtype: torch.dtype, slot: tuple[Path, dict] | None,
                 entry: weight_cache.CacheEntry | None) -> tuple[Transformer, bool, str]:
    """The model with `fmt` projections on the native kernels: from the verified cache
    `entry` when there is one (True), else repacked from the file (False) and, with a cache
    `slot`, written there; and how its tensors were carried (`LoadedModel.carried`)."""
    index = tensor_index(gguf_file)
    shapes = {n: t.shape for n, t in index.items() if _is_projection(n)}
    if entry is not None:
        model = _from_entry(cfg, entry, shapes)
        if model is not None:
            return model, True, entry.meta.get("carried", "")
        log.warning("weight cache %s does not fit this model; rebuilding it", entry.path)
    weight_cache.say(f"repacking {gguf_file.path.name} for the native kernels ({fmt}; once: "
                     f"{'then cached' if slot else 'cache off'})")
    model, dense, carried = _repack(gguf_file, cfg, index, shapes, bits, fmt, dtype)
    weight_cache.say(carried)
    if slot is not None:
        tensors, meta = _pack(model, dense)
        meta["carried"] = carried
        try:
            weight_cache.write(slot[0], slot[1], tensors, meta)
        except OSError as e:
            log.warning("cannot write the weight cache %s (%s); the next load repacks again",
                        slot[0], e)
    return model, False, carried


def _cache_key(source: Path, directory: Path, fmt: str, dtype: torch.dtype) -> dict:
    """Everything the repacked weights depend on."""
    lib = kernels.qmatmul()
    code = hashlib.sha256()
    for obj in (*_CACHED_CODE, _repack, _part, _merged):
        code.update(inspect.getsource(obj).encode())
    return {"cache_version": weight_cache.CACHE_VERSION,
            "source_sha256": weight_cache.source_sha256(source, directory),
            "format": fmt, "dtype": str(dtype), "layout": NATIVE_LAYOUT_VERSION,
            "sc_max": [lib.q_sc_max(4), lib.q_sc_max(6), lib.q_sc_max(8)],
            "four_bit_source_max": FOUR_BIT_SOURCE_MAX, "six_bit_source_max": SIX_BIT_SOURCE_MAX,
            "code": code.hexdigest()}


def _skeleton(cfg: ModelConfig, dense: dict[str, torch.Tensor],
              shapes: dict[str, tuple[int, ...]]) -> Transformer:
    """A `Transformer` whose projections are empty placeholders (no rows) until the quantized
    layers replace them (callers replace every one). Not meta tensors: the first meta-device
    op imports half of torch's compiler stack."""
    weights = dict(dense)
    for name, shape in shapes.items():
        weights[name] = torch.empty((0, *shape[1:]))
    return Transformer(cfg, weights)


def _repack(gguf_file: GGUFFile, cfg: ModelConfig, index: dict, shapes: dict,
            bits: dict[str, float], fmt: str, dtype: torch.dtype
            ) -> tuple[Transformer, dict[str, torch.Tensor], str]:
    """Every projection from the file's tensors, layer by layer (`_part`); returns the model,
    its dense tensors and how the tensors were carried (`_carried`)."""
    dense = {n: read_tensor(gguf_file, cfg, t, dtype) for n, t in index.items()
             if not _is_projection(n)}
    model = _skeleton(cfg, dense, shapes)
    notes: Counter = Counter()

    def projection(names: list[str], biases: list[str]) -> NativeLinear:
        parts = []
        for name in names:
            part, note = _part(gguf_file, cfg, index[name], fmt)
            parts.append(part)
            notes[note] += 1
        bias = torch.cat([read_tensor(gguf_file, cfg, index[b], torch.float32) for b in biases]) \
            if biases else None
        return NativeLinear.from_parts(_merged(parts), bias)

    with weight_cache.progress_bar(cfg.num_layers + 1, f"repack {fmt}", "layer") as bar:
        for i, layer in enumerate(model.layers):
            for attr, names in layer_projections(i).items():
                biases = [n.replace(".weight", ".bias") for n in names]
                setattr(layer, attr, projection(names, [b for b in biases if b in index]))
            bar.update(1)
        model.lm_head = projection([head_source(bits)], [])
        bar.update(1)
    model.act_dtype = torch.float32  # the native kernels take float32
    return model, dense, _carried(notes)


def _part(gguf_file: GGUFFile, cfg: ModelConfig, tensor: GGUFTensor, fmt: str
          ) -> tuple[Part, str]:
    """One projection tensor for `fmt`, and a note of how: a quantized type as the file's own
    blocks (int4: every one; int4-all: those at 4 bits; int8: Q8_0), anything else quantized
    anew from its float values: to 4 bits (int4-all), or 8 (int4's and int8's float tensors,
    int8's other types)."""
    qtype = tensor.qtype
    if _own_blocks(fmt, qtype):
        rows, cols = tensor.shape
        raw = torch.from_numpy(np.array(gguf_file.raw(tensor))).reshape(rows, -1)  # [rows, bytes]
        name = hf_name(tensor.name, cfg.architecture, cfg.num_layers) or ""
        if cfg.architecture == "llama" and "q_proj" in name:
            raw = unpermute(raw, cfg.num_heads)  # rows only: each row's blocks stay whole
        elif cfg.architecture == "llama" and "k_proj" in name:
            raw = unpermute(raw, cfg.num_kv_heads)
        w = native_blocks(raw.numpy(), qtype, rows, cols)
        return w, f"{qtype.name} as {KIND_NAMES[w.kind]}"
    width = 4 if fmt == "int4-all" else 8
    lib = kernels.qmatmul()
    w = read_tensor(gguf_file, cfg, tensor, torch.float32)
    return (quantize_native(w, width, lib.q_sc_max(width)),
            f"{qtype.name} re-quantized to {width} bits")


def _own_blocks(fmt: str, qtype) -> bool:
    """Whether `fmt` carries tensors of `qtype` as the file's own blocks (see `_part`)."""
    return carries(qtype) and (fmt == "int4" or (fmt == "int4-all" and qtype.name in FOUR_BIT_TYPES)
                               or (fmt == "int8" and qtype.name == "Q8_0"))


def _merged(parts: list[Part]) -> tuple[Part, ...]:
    """Adjacent parts of one kind stacked into one (the first whole tiles): the fused q/k/v of
    a file that stores all three alike is one part."""
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if (isinstance(p, NativeWeights) and isinstance(last, NativeWeights)
                and (p.kind, p.sb, p.zero) == (last.kind, last.sb, last.zero)
                and (last.kind == KIND_R8 or last.out_features % LANES == 0)):
            out[-1] = concat([last, p])
        else:
            out.append(p)
    return tuple(out)


def _carried(notes: Counter) -> str:
    """E.g. "the file's own blocks: Q4_K as 4-bit ×169, Q6_K as 6-bit, scales per 16 ×29"."""
    own = [f"{n} ×{c}" for n, c in sorted(notes.items()) if " as " in n]
    anew = [f"{n} ×{c}" for n, c in sorted(notes.items()) if " as " not in n]
    return "; ".join(([f"the file's own blocks: {', '.join(own)}"] if own else [])
                     + ([f"quantized anew: {', '.join(anew)}"] if anew else []))


def _native_linears(model: Transformer) -> dict[str, NativeLinear]:
    """Every quantized layer of `model` by attribute path ("layers.3.qkv", "lm_head")."""
    out = {f"layers.{i}.{attr}": getattr(layer, attr) for i, layer in enumerate(model.layers)
           for attr in layer_projections(i)}
    out["lm_head"] = model.lm_head
    return out


def _pack(model: Transformer, dense: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The tensors and meta of a cache entry for `model`."""
    tensors = {f"dense.{n}": t for n, t in dense.items()}
    linears = {}
    for where, lin in _native_linears(model).items():
        specs = []
        for i, part in enumerate(lin.parts):
            if isinstance(part, torch.Tensor):
                tensors[f"linear.{where}.{i}.weight"] = part
                specs.append({"dense": True})
                continue
            fields, plain = native_weights_to_tensors(part)
            tensors.update({f"linear.{where}.{i}.{f}": t for f, t in fields.items()})
            specs.append({"plain": plain, "tensors": sorted(fields)})
        if lin.bias is not None:
            tensors[f"linear.{where}.bias"] = lin.bias
        linears[where] = {"parts": specs, "bias": lin.bias is not None}
    return tensors, {"dense": sorted(dense), "linears": linears}


def _from_entry(cfg: ModelConfig, entry: weight_cache.CacheEntry,
                shapes: dict[str, tuple[int, ...]]) -> Transformer | None:
    """The model from a verified cache entry; None if the entry does not fit `cfg`."""
    try:
        return _assemble(cfg, entry, shapes)
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None


def _assemble(cfg: ModelConfig, entry: weight_cache.CacheEntry,
              shapes: dict[str, tuple[int, ...]]) -> Transformer | None:
    t, meta = entry.tensors, entry.meta
    dense = {n: t[f"dense.{n}"] for n in meta["dense"]}
    model = _skeleton(cfg, dense, shapes)
    expected = set(_native_linears(model))
    if set(meta["linears"]) != expected:
        return None
    for where, spec in meta["linears"].items():
        parts = tuple(t[f"linear.{where}.{i}.weight"] if p.get("dense") else
                      native_weights_from_tensors(
                          {f: t[f"linear.{where}.{i}.{f}"] for f in p["tensors"]}, p["plain"])
                      for i, p in enumerate(spec["parts"]))
        lin = NativeLinear.from_parts(parts, t[f"linear.{where}.bias"] if spec["bias"] else None)
        if where == "lm_head":
            model.lm_head = lin
        else:
            _, i, attr = where.split(".")
            setattr(model.layers[int(i)], attr, lin)
    model.act_dtype = torch.float32
    return model
