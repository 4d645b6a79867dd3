"""The native glue of a decoder layer (`rms_norm`, `rope_store_attend`, `silu_mul` in
`specserve/kernels/attention.c`) and the transformer's pass built on it: each against the
PyTorch formula, bit-for-bit batch invariance, bad indices refused before anything is written,
and a whole pass equal to the PyTorch path within float32 rounding."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.models import transformer
from specserve.models.attention import ragged_attention
from specserve.models.transformer import Transformer, rms_norm, rotate_half
from tests import tiny
from tests.models.test_attention import make_sequences, paged
from tests.slots import new_cache as slot_cache



def lib_for(isa: str):
    if isa not in kernels.available_isas():
        pytest.fail(f"this CPU lacks {isa}")  # every CI machine runs avx2
    return kernels.attention(isa)


ISAS = list(kernels.available_isas())


def native_rms_norm(lib, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    assert lib.rms_norm(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), ctypes.c_float(eps),
                        out.data_ptr()) == 0
    return out


def native_silu_mul(lib, gu: torch.Tensor) -> torch.Tensor:
    out = torch.empty((gu.shape[0], gu.shape[1] // 2))
    assert lib.silu_mul(gu.data_ptr(), gu.shape[0], out.shape[1], out.data_ptr()) == 0
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dim", [64, 1536, 100])  # 100: a tail past the last 8 lanes
def test_rms_norm_matches_torch_and_each_row_is_batch_invariant(isa, dim):
    lib = lib_for(isa)
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(40, dim, generator=g) * 3  # 40 rows: the parallel loop runs
    w = torch.randn(dim, generator=g)
    got = native_rms_norm(lib, x, w, 1e-6)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    for r in (0, 17, 39):
        assert torch.equal(native_rms_norm(lib, x[r:r + 1].clone(), w, 1e-6), got[r:r + 1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("inter", [96, 8960, 13])  # 13: the scalar tail only
def test_silu_mul_matches_torch_over_the_whole_range(isa, inter):
    lib = lib_for(isa)
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(20, 2 * inter, generator=g) * 6
    gu[0, :inter] = torch.linspace(-120, 120, inter)  # saturated tails, zero, tiny values
    got = native_silu_mul(lib, gu)
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(got).all()
    assert torch.equal(native_silu_mul(lib, gu[5:6].clone()), got[5:6])


def rope_case(heads: int, kv_heads: int, hd: int, lengths: list[int], block_size: int, seed: int):
    """Pools holding `lengths` cached positions per sequence, and one new row per sequence at
    its next position (plus a second row for sequence 0): qkv rows, cos/sin, indices."""
    keys, values = make_sequences([n + 2 for n in lengths], kv_heads, hd, seed)
    k_pool, v_pool, tables = paged(keys, values, block_size, seed)
    row_seq = torch.tensor([0, 0] + list(range(1, len(lengths))), dtype=torch.int32)
    row_pos = torch.tensor([lengths[0], lengths[0] + 1] + lengths[1:], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(row_seq), (heads + 2 * kv_heads) * hd, generator=g)
    freqs = row_pos.float()[:, None] * torch.rand(hd // 2, generator=g)  # [rows, hd / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return qkv, emb.cos(), emb.sin(), k_pool, v_pool, tables, row_seq, row_pos


def native_rope_attend(lib, heads, kv_heads, hd, qkv, cos, sin, k_pool, v_pool, tables, row_seq,
                       row_pos, kind: int | None = None) -> tuple[int, torch.Tensor]:
    """`rope_store_attend` on pools of any dtype (its element kind, unless `kind` is given)."""
    out = torch.empty(qkv.shape[0], heads, hd)
    kind = kernels.KV_KINDS[k_pool.dtype] if kind is None else kind
    rc = lib.rope_store_attend(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, hd, cos.data_ptr(),
                               sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                               kind, k_pool.shape[0], k_pool.shape[2], tables.data_ptr(),
                               tables.shape[0], tables.shape[1], row_seq.data_ptr(),
                               row_pos.data_ptr(), ctypes.c_float(1 / math.sqrt(hd)),
                               out.data_ptr())
    return rc, out


def pytorch_rope_store_attend(qkv, cos, sin, k_pool, v_pool, tables, row_seq, row_pos, heads,
                              kv_heads, hd, block_size: int = 4):
    """The PyTorch steps a native `rope_store_attend` repeats: x·cos + rotate_half(x)·sin on q
    and k, the write of k and v into copies of the pools (rounded to their dtype), then
    ragged_attention. Returns (rotated q, keys, values, attention output)."""
    rows = qkv.shape[0]
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    c, s = cos[:, None], sin[:, None]
    q = q.reshape(rows, heads, hd) * c + rotate_half(q.reshape(rows, heads, hd)) * s
    k = k.reshape(rows, kv_heads, hd) * c + rotate_half(k.reshape(rows, kv_heads, hd)) * s
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    for r in range(rows):
        block = int(tables[row_seq[r], row_pos[r] // block_size])
        k_ref[block, :, row_pos[r] % block_size] = k[r].to(k_ref.dtype)
        v_ref[block, :, row_pos[r] % block_size] = v[r].reshape(kv_heads, hd).to(v_ref.dtype)
    return q, k_ref, v_ref, ragged_attention(q, k_ref, v_ref, tables, row_seq, row_pos)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 16), (12, 2, 128)])
def test_rope_store_attend_is_bit_identical_to_the_pytorch_steps(isa, heads, kv_heads, hd):
    """The PyTorch path: x·cos + rotate_half(x)·sin, the cache write, ragged_attention."""
    lib = lib_for(isa)
    qkv, cos, sin, k_pool, v_pool, tables, row_seq, row_pos = rope_case(
        heads, kv_heads, hd, [5, 19, 1], block_size=4, seed=hd)
    q, k_ref, v_ref, want = pytorch_rope_store_attend(qkv, cos, sin, k_pool, v_pool, tables,
                                                      row_seq, row_pos, heads, kv_heads, hd)
    rc, got = native_rope_attend(lib, heads, kv_heads, hd, qkv, cos, sin, k_pool, v_pool, tables,
                                 row_seq, row_pos)
    assert rc == 0
    assert torch.equal(got, want)
    assert torch.equal(k_pool.nan_to_num(7.0), k_ref.nan_to_num(7.0))  # NaN: never written
    assert torch.equal(v_pool.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_attend_refuses_a_bad_index_before_writing(dtype):
    lib = kernels.attention()
    qkv, cos, sin, k_pool, v_pool, tables, row_seq, row_pos = rope_case(
        4, 2, 16, [5, 19, 1], block_size=4, seed=3)
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    before = (k_pool.clone(), v_pool.clone())
    for bad_seq, bad_pos in ((7, None), (None, 10_000)):
        seqs, pos = row_seq.clone(), row_pos.clone()
        if bad_seq is not None:
            seqs[-1] = bad_seq
        else:
            pos[-1] = bad_pos
        rc, _ = native_rope_attend(lib, 4, 2, 16, qkv, cos, sin, k_pool, v_pool, tables, seqs, pos)
        assert rc == -3
        assert torch.equal(k_pool.nan_to_num(7.0), before[0].nan_to_num(7.0))
        assert torch.equal(v_pool.nan_to_num(7.0), before[1].nan_to_num(7.0))
    rc, _ = native_rope_attend(lib, 4, 2, 16, qkv, cos, sin, k_pool, v_pool, tables, row_seq,
                               row_pos, kind=3)  # no such element kind
    assert rc == -2
    assert torch.equal(k_pool.nan_to_num(7.0), before[0].nan_to_num(7.0))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_native_pass_matches_the_pytorch_pass(tmp_path, monkeypatch, weights, cache_dtype):
    """The whole decoder: prompt logits of the native pass against the PyTorch pass (the same
    model, the glue switched off), within float32 rounding, and both write the same cache.
    A float16 cache: where the two paths' float32 keys differ in the last bit (their norms
    round differently), the float16 rounding may fall either way, so a rare entry is one
    float16 step (2^-10 relative, 2^-24 among subnormals) apart; the logits stay within
    float32 rounding."""
    from specserve.weights.loader import load_model
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path / "m")
    model = load_model(path, "float32", weights=weights).model
    assert model._native_layers(torch.zeros(1))
    native_slots = slot_cache(model, 2, 64, dtype=cache_dtype)
    batch = native_slots.batch([list(range(3, 40)), [5, 9, 2]], [0, 0], [0, 1])
    native_cache = native_slots.pool
    native = model.forward(batch, native_cache)
    monkeypatch.setattr(Transformer, "_native_layers", lambda self, x: False)
    torch_cache = slot_cache(model, 2, 64, dtype=cache_dtype).pool
    reference = model.forward(batch, torch_cache)
    assert native_cache.keys.dtype == torch_cache.keys.dtype == cache_dtype
    for a, b in zip(native, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for pools in ((native_cache.keys, torch_cache.keys), (native_cache.values, torch_cache.values)):
        used = [p[:, :2] for p in pools]  # the blocks the two sequences use
        if cache_dtype == torch.float32:
            torch.testing.assert_close(used[0], used[1], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(used[0].float(), used[1].float(), rtol=2 ** -10,
                                       atol=2 ** -24)
            assert (used[0] != used[1]).sum() <= used[0].numel() // 100


def test_bf16_activations_take_the_pytorch_path(tmp_path):
    from specserve.weights.loader import load_model
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path / "m")
    model = load_model(path, "bfloat16", weights="bf16").model
    assert not model._native_layers(torch.zeros(1, dtype=model.act_dtype))
    assert transformer.ATTN_DTYPE == torch.float32
