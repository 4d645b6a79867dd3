"""The weight cache (repacked weights mapped from disk on every load after the first) and
`weights="auto"`, on tiny GGUF files written here."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specserve import kernels
from specserve.weights import quant, weight_cache
from specserve.weights.loader import load_model
from specserve.weights.quant import NativeLinear
from specserve.models.transformer import Linear
from tests import tiny
from tests.slots import new_cache as slot_cache

IDS = [5, 17, 33, 8, 90, 41, 3, 60]
MIX = {"default": T.Q4_K, "ffn": T.Q6_K, "embed": T.Q5_K}  # a Q4_K_M-like mix


def write_gguf(tmp_path, types=MIX, seed=0, arch="qwen2", name="m.gguf"):
    hf_model = tiny.build_hf_model(arch, seed=seed, hidden_size=256, intermediate_size=512)
    path, _ = tiny.write_gguf_pair(hf_model, arch, types, tmp_path / name, tmp_path / f"hf-{name}",
                                   seed=seed)
    return path


def logits(loaded) -> torch.Tensor:
    m = loaded.model
    cache = slot_cache(m, 1, 32)
    return m.forward(cache.batch([IDS], [0], [0]), cache.pool)[0]  # [T, vocab]


def entries(directory):
    return sorted(directory.glob(f"*{weight_cache.SUFFIX}"))


def test_second_load_maps_the_cache_with_identical_logits(tmp_path, cache, repacks):
    path = write_gguf(tmp_path)
    fresh = load_model(path, weights="int4", weight_cache=False)
    assert not entries(cache) and repacks
    first = load_model(path, weights="int4")
    assert not first.cache_hit and len(entries(cache)) == 1
    repacks.clear()
    second = load_model(path, weights="int4")
    assert second.cache_hit and not repacks
    assert isinstance(second.model.layers[1].down, NativeLinear)
    assert second.model.layers[1].down.w.bits == 6  # Q6_K: its qh comes from the cache too
    assert second.model.layers[1].down.w.qh is not None
    assert second.model.act_dtype == torch.float32
    assert torch.equal(logits(second), logits(first))
    assert torch.equal(logits(second), logits(fresh))


@pytest.mark.parametrize("damage", ["flip a byte in the middle", "flip a byte of the index",
                                    "truncate"])
def test_a_damaged_entry_is_rebuilt_never_used(tmp_path, cache, repacks, damage):
    path = write_gguf(tmp_path)
    reference = logits(load_model(path, weights="int4"))
    (entry,) = entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        at = len(data) // 2 if "middle" in damage else len(data) - 50
        data[at] ^= 0x10
    entry.write_bytes(bytes(data))
    repacks.clear()
    rebuilt = load_model(path, weights="int4")
    assert not rebuilt.cache_hit and repacks  # detected: repacked from the file
    assert torch.equal(logits(rebuilt), reference)
    again = load_model(path, weights="int4")  # the rewritten entry is whole again
    assert again.cache_hit and torch.equal(logits(again), reference)


def test_a_flipped_weight_byte_changes_the_checksum():
    data = torch.zeros(3 * weight_cache.CHUNK_BYTES, dtype=torch.uint8)
    data[12345] = 7
    base = weight_cache.checksum(data)
    for at, value in [(12345, 8), (weight_cache.CHUNK_BYTES + 8, 1), (len(data) - 1, 0x80)]:
        damaged = data.clone()
        damaged[at] = value
        assert weight_cache.checksum(damaged) != base, at
    moved = data.view(3, -1).flip(0).reshape(-1)  # same bytes, chunks in another order
    assert weight_cache.checksum(moved) != base


def test_a_changed_source_file_is_rebuilt(tmp_path, cache):
    path = write_gguf(tmp_path, seed=0)
    old = logits(load_model(path, weights="int4"))
    path.unlink()
    write_gguf(tmp_path, seed=1)  # same name, other weights
    new = load_model(path, weights="int4")
    assert not new.cache_hit
    assert torch.equal(logits(new), logits(load_model(path, weights="int4", weight_cache=False)))
    assert not torch.equal(logits(new), old)
    assert len(entries(cache)) == 1  # the old entry went


def test_a_new_kernel_layout_version_rebuilds(tmp_path, cache, monkeypatch, repacks):
    from specserve.weights import loader

    path = write_gguf(tmp_path)
    load_model(path, weights="int4")
    monkeypatch.setattr(loader, "NATIVE_LAYOUT_VERSION", "bumped")
    repacks.clear()
    rebuilt = load_model(path, weights="int4")
    assert not rebuilt.cache_hit and repacks
    assert load_model(path, weights="int4").cache_hit and len(entries(cache)) == 1


def test_repacks_of_the_re_quantizing_code_are_rebuilt(tmp_path, cache, monkeypatch, repacks):
    """Entries written before the file's own blocks (cache version 1, layout 3) are never read:
    the first load after the change repacks, and says how it carried the tensors."""
    from specserve.weights import loader, weight_cache

    assert (weight_cache.CACHE_VERSION, loader.NATIVE_LAYOUT_VERSION) == (2, "4")
    path = write_gguf(tmp_path)
    with monkeypatch.context() as old:
        old.setattr(weight_cache, "CACHE_VERSION", 1)
        old.setattr(loader, "NATIVE_LAYOUT_VERSION", "3")
        load_model(path, weights="int4")
    repacks.clear()
    rebuilt = load_model(path, weights="int4")
    assert not rebuilt.cache_hit and repacks
    assert rebuilt.carried.startswith("the file's own blocks: Q4_K as 4-bit")
    again = load_model(path, weights="int4")
    assert again.cache_hit and again.carried == rebuilt.carried


def test_the_source_is_hashed_once_per_version_of_the_file(tmp_path, cache, monkeypatch):
    path = write_gguf(tmp_path)
    said = []
    monkeypatch.setattr(weight_cache, "say", said.append)
    first = weight_cache.source_sha256(path, cache)
    assert weight_cache.source_sha256(path, cache) == first
    assert sum("hashing" in s for s in said) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))  # touched
    assert weight_cache.source_sha256(path, cache) == first
    assert sum("hashing" in s for s in said) == 2


def test_each_format_gets_its_own_entry(tmp_path, cache):
    path = write_gguf(tmp_path)
    first = {fmt: load_model(path, weights=fmt) for fmt in ("int4", "int8")}
    assert len(entries(cache)) == 2
    for fmt, loaded in first.items():
        again = load_model(path, weights=fmt)
        assert again.cache_hit and again.weights == fmt
        assert torch.equal(logits(again), logits(loaded))
    assert first["int8"].model.layers[0].qkv.w.bits == 8
    assert first["int4"].model.layers[0].qkv.w.bits == 4


def test_native_weights_round_trip_through_their_tensors():
    """Every field, the v3 ones included (dmin, and out_features: 40 outputs fill 3 tiles of
    16, so the arrays alone would say 48), through JSON as the cache's meta does."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 256, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 256, generator=g)
    for bits in (4, 6, 8):
        lin = NativeLinear(w, b, bits)
        tensors, plain = quant.native_weights_to_tensors(lin.w)
        assert ("qh" in tensors) == (bits == 6)
        assert ("dmin" in tensors) == ("mins" in tensors) == (bits != 8)
        assert plain["out_features"] == 40
        plain = json.loads(json.dumps(plain))
        copy = NativeLinear.from_weights(quant.native_weights_from_tensors(
            {k: v.clone() for k, v in tensors.items()}, plain), lin.bias.clone())
        assert (copy.out_features, copy.in_features) == (40, 256)
        for f in dataclasses.fields(lin.w):
            mine, theirs = getattr(lin.w, f.name), getattr(copy.w, f.name)
            assert torch.equal(mine, theirs) if torch.is_tensor(mine) else mine == theirs, f.name
        assert torch.equal(copy(x), lin(x)) and copy(x).shape == (3, 40)


@pytest.mark.parametrize("types", [MIX, {"default": T.Q4_0}], ids=["Q4_K_M-like", "Q4_0"])
def test_auto_keeps_a_quantized_file_quantized_int4_style(tmp_path, cache, types):
    path = write_gguf(tmp_path, types)
    auto = load_model(path)
    assert auto.weights == "int4" and auto.model.act_dtype == torch.float32
    layer = auto.model.layers[0]
    assert isinstance(layer.qkv, NativeLinear) and layer.qkv.w.bits == 4
    wide = 6 if types is MIX else 4  # Q6_K ffn tensors keep 6 bits, as llama.cpp's mix
    assert layer.gate_up.w.bits == wide and layer.down.w.bits == wide
    assert torch.equal(logits(auto), logits(load_model(path, weights="int4")))


def test_a_draft_model_loads_every_projection_and_the_head_at_4_bits(tmp_path, cache):
    """A draft (`draft=True`) narrows int4 to int4-all: the Q6_K ffn tensors, which int4 keeps
    at 6 bits, and the head go to 4 bits too, in an entry of their own; a format asked for by
    name, and a float file, are loaded as for a target."""
    path = write_gguf(tmp_path)
    target, draft = load_model(path), load_model(path, draft=True)
    assert (target.weights, draft.weights) == ("int4", "int4-all")
    assert target.model.layers[0].gate_up.w.bits == 6
    projections = [getattr(layer, name) for layer in draft.model.layers
                   for name in ("qkv", "o", "gate_up", "down")] + [draft.model.lm_head]
    assert all(isinstance(p, NativeLinear) and p.w.bits == 4 for p in projections)
    assert len(entries(cache)) == 2
    again = load_model(path, draft=True)
    assert again.cache_hit and torch.equal(logits(again), logits(draft))
    assert not torch.equal(logits(draft), logits(target))
    assert load_model(path, weights="int8", draft=True).weights == "int8"
    assert load_model(write_gguf(tmp_path, {"default": T.F32}, name="f.gguf"),
                      draft=True).weights == "bf16"


def test_the_llm_loads_its_draft_int4_all_unless_the_config_names_a_format(tmp_path, cache):
    from specserve.llm import LLM

    path = str(write_gguf(tmp_path))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    assert LLM(path, speculative_config=spec).draft.weights == "int4-all"
    named = LLM(path, speculative_config=spec | {"draft_weights": "int4"})
    assert named.draft.weights == "int4" and named.target.weights == "int4"


def test_auto_loads_a_float_file_dense(tmp_path, cache):
    path = write_gguf(tmp_path, {"default": T.F32})
    auto = load_model(path)
    assert auto.weights == "bf16" and auto.model.dtype == torch.bfloat16
    assert type(auto.model.layers[0].qkv) is Linear
    f32 = load_model(path, "float32")
    assert f32.weights == "float32" and f32.model.dtype == torch.float32
    assert not entries(cache)


def test_auto_falls_back_to_bfloat16_without_the_native_kernels(tmp_path, cache, monkeypatch):
    path = write_gguf(tmp_path)
    monkeypatch.setattr(kernels, "qmatmul", lambda *a: None)
    auto = load_model(path)
    assert auto.weights == "bf16" and type(auto.model.layers[0].qkv) is Linear


def test_auto_is_the_default_of_the_api_and_the_commands():
    from specserve.cli import build_parser
    from specserve.llm import LLM

    for params in (inspect.signature(LLM.__init__).parameters,
                   inspect.signature(load_model).parameters):
        assert params["weights"].default == "auto" and params["dtype"].default == "auto"
    parser = build_parser()
    for command in (["generate"], ["demo"], ["bench"], ["serve"]):
        args = parser.parse_args(command)
        assert args.weights == "auto" and args.dtype == "auto", command


def test_bad_weights_or_dtype_are_refused_before_loading():
    with pytest.raises(ValueError, match="weights"):
        load_model("/nonexistent", weights="int3")
    with pytest.raises(ValueError, match="dtype"):
        load_model("/nonexistent", dtype="float64")
    with pytest.raises(ValueError, match="dtype"):
        load_model("/nonexistent", dtype="bfloat16", weights="float32")
