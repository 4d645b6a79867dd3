"""Narrow KV caches (float16, bfloat16): stores round to nearest even exactly as PyTorch's
`.to(dtype)`, in `KVCache.write` and in the native `rope_store_attend`; attention reads the
pools widened to float32, so over a narrow pool it gives the same bits as over a float32 pool
holding the widened values, and matches the PyTorch oracle within float32 rounding."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from specserve import kernels
from specserve.models.attention import ragged_attention, ragged_attention_reference
from specserve.models.kv_cache import KVCache, check_kv_cache_dtype, resolve_kv_cache_dtype
from tests.models.test_attention import ATOL, LENGTHS, ROWS_OF, make_sequences, paged, ragged_batch
from tests.models.test_layer_glue import ISAS, lib_for, pytorch_rope_store_attend, rope_case

NARROW = [torch.float16, torch.bfloat16]


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values that exercise the rounding to `dtype`: exact ties (to even, up and
    down), overflow to ±inf, the largest finite value, subnormals, ±0, and plain randoms."""
    if dtype == torch.float16:
        edge = [1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 65504.0, 65519.0, 65520.0,
                -70000.0, 1.5 * 2 ** -24, 2 ** -25, 0.75 * 2 ** -24, 3e-5]
    else:
        edge = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38, 3.4e38, -3.4e38,
                1e-40, 1.5 * 2 ** -133, 2 ** -134, 7e-39, 1e-3]
    g = torch.Generator().manual_seed(1)
    rest = torch.randn(64 - len(edge) - 2, generator=g) * 100
    return torch.cat([torch.tensor(edge + [0.0, -0.0]), rest])  # [64]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", NARROW)
def test_kv_cache_write_stores_exactly_the_dtype_rounding(dtype):
    cache = KVCache(2, 4, 2, 4, 16, dtype)  # layers, blocks, kv heads, block size, head dim
    x = special_values(dtype)  # [64]
    k = x.view(2, 2, 16)  # [rows, kv_head, head_dim]
    v = -x.flip(0).view(2, 2, 16)
    slots = torch.tensor([5, 14])  # block 1 offset 1, block 3 offset 2
    cache.write(1, slots, k, v)
    assert cache.keys.dtype == dtype == cache.values.dtype
    for r, s in enumerate(slots.tolist()):
        assert same_bits(cache.keys[1, s // 4, :, s % 4], k[r].to(dtype))
        assert same_bits(cache.values[1, s // 4, :, s % 4], v[r].to(dtype))


def store_case(dtype: torch.dtype, hd: int = 16, kv_heads: int = 2, heads: int = 4):
    """One row per sequence whose v is `special_values` and whose rotation is the identity
    (cos 1, sin 0), so the pool must hold exactly the values' rounding."""
    vals = special_values(dtype)[:kv_heads * hd]  # [kv_heads * hd]
    rows = 2
    qkv = torch.zeros(rows, (heads + 2 * kv_heads) * hd)
    qkv[:, heads * hd:(heads + kv_heads) * hd] = torch.randn(rows, kv_heads * hd)
    qkv[:, (heads + kv_heads) * hd:] = vals
    cos, sin = torch.ones(rows, hd), torch.zeros(rows, hd)
    k_pool = torch.zeros(3, kv_heads, 4, hd, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    tables = torch.tensor([[2], [0]], dtype=torch.int32)
    row_seq = torch.tensor([0, 1], dtype=torch.int32)
    row_pos = torch.tensor([0, 0], dtype=torch.int32)
    return qkv, cos, sin, k_pool, v_pool, tables, row_seq, row_pos


def native_rope_attend(lib, heads, kv_heads, hd, qkv, cos, sin, k_pool, v_pool, tables, row_seq,
                       row_pos, kind=None) -> tuple[int, torch.Tensor]:
    out = torch.empty(qkv.shape[0], heads, hd)
    rc = lib.rope_store_attend(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, hd, cos.data_ptr(),
                               sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                               kernels.KV_KINDS[k_pool.dtype] if kind is None else kind,
                               k_pool.shape[0], k_pool.shape[2], tables.data_ptr(),
                               tables.shape[0], tables.shape[1], row_seq.data_ptr(),
                               row_pos.data_ptr(), ctypes.c_float(1 / math.sqrt(hd)),
                               out.data_ptr())
    return rc, out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", NARROW)
def test_rope_store_attend_rounds_like_torch_to(isa, dtype):
    """Ties to even, overflow to inf, subnormals: the native store is `x.to(dtype)` bit for bit."""
    lib = lib_for(isa)
    qkv, cos, sin, k_pool, v_pool, tables, row_seq, row_pos = store_case(dtype)
    rc, _ = native_rope_attend(lib, 4, 2, 16, qkv, cos, sin, k_pool, v_pool, tables, row_seq,
                               row_pos)
    assert rc == 0
    for r, block in enumerate((2, 0)):
        k = qkv[r, 64:96].view(2, 16)  # the identity rotation: k itself
        v = qkv[r, 96:].view(2, 16)
        assert same_bits(k_pool[block, :, 0], k.to(dtype))
        assert same_bits(v_pool[block, :, 0], v.to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 16), (12, 2, 128)])
def test_rope_store_attend_on_narrow_pools_equals_the_pytorch_steps(isa, dtype, heads, kv_heads,
                                                                    hd):
    """PyTorch's rotary embedding, a write rounded to the pool's dtype, ragged_attention: the
    native step stores the same bits and returns the same bits, which are also the bits of
    attention over float32 pools holding the widened values."""
    lib = lib_for(isa)
    qkv, cos, sin, k32, v32, tables, row_seq, row_pos = rope_case(
        heads, kv_heads, hd, [5, 19, 1], block_size=4, seed=hd)
    k_pool, v_pool = k32.to(dtype), v32.to(dtype)  # NaN where nothing was written
    q, k_ref, v_ref, want = pytorch_rope_store_attend(qkv, cos, sin, k_pool, v_pool, tables,
                                                      row_seq, row_pos, heads, kv_heads, hd)
    rc, got = native_rope_attend(lib, heads, kv_heads, hd, qkv, cos, sin, k_pool, v_pool, tables,
                                 row_seq, row_pos)
    assert rc == 0
    assert same_bits(k_pool.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert same_bits(v_pool.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert torch.equal(got, want)
    widened = ragged_attention(q, k_ref.float(), v_ref.float(), tables, row_seq, row_pos)
    assert torch.equal(got, widened)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("heads, kv_heads, hd", [(4, 2, 16), (12, 2, 128), (16, 2, 24)])
def test_native_attention_on_narrow_pools_matches_the_reference_on_widened_values(
        dtype, heads, kv_heads, hd):
    keys, values = make_sequences(LENGTHS, kv_heads, hd, seed=heads * 100 + hd)
    k32, v32, tables = paged(keys, values, block_size=16, seed=hd)
    k_pool, v_pool = k32.to(dtype), v32.to(dtype)
    q, row_seq, row_pos = ragged_batch(heads, hd, LENGTHS, ROWS_OF, seed=heads)
    got = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos)
    ref = ragged_attention_reference(q, k_pool, v_pool, tables, row_seq, row_pos)
    torch.testing.assert_close(got, ref, rtol=ATOL, atol=ATOL)
    assert torch.equal(got, ragged_attention(q, k_pool.float(), v_pool.float(), tables, row_seq,
                                             row_pos))
    for r in (0, 9, len(row_seq) - 1):  # a row alone gives the same bits (batch invariance)
        alone = ragged_attention(q[r:r + 1], k_pool, v_pool, tables, row_seq[r:r + 1],
                                 row_pos[r:r + 1])
        assert torch.equal(alone, got[r:r + 1])


def test_mixed_or_unsupported_pool_dtypes_are_refused():
    keys, values = make_sequences([5], 2, 16, seed=0)
    k32, v32, tables = paged(keys, values, block_size=4, seed=0)
    q, row_seq, row_pos = ragged_batch(4, 16, [5], [[4]], seed=0)
    with pytest.raises(ValueError, match="k_pool, v_pool"):
        ragged_attention(q, k32.half(), v32, tables, row_seq, row_pos)
    with pytest.raises(ValueError, match="k_pool, v_pool"):
        ragged_attention(q, k32.double(), v32.double(), tables, row_seq, row_pos)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        KVCache(1, 2, 1, 4, 8, torch.float64)


def test_kv_cache_dtype_names_resolve_and_bad_ones_name_the_field():
    assert resolve_kv_cache_dtype("auto", True, torch.float32) == torch.float16
    assert resolve_kv_cache_dtype("auto", False, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", False, torch.float32) == torch.float32
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16),
                        ("bfloat16", torch.bfloat16)):
        assert resolve_kv_cache_dtype(name, True, torch.float32) == dtype
        assert resolve_kv_cache_dtype(name, False, torch.bfloat16) == dtype
    for bad in ("fp8", "half", "", None, torch.float16, 16):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            check_kv_cache_dtype(bad)


def test_bytes_per_token_halves_with_a_float16_cache():
    f32 = KVCache.bytes_per_token(28, 2, 128, torch.float32)
    assert f32 == 28 * 2 * 2 * 128 * 4
    assert KVCache.bytes_per_token(28, 2, 128, torch.float16) * 2 == f32
    assert KVCache.bytes_per_token(28, 2, 128, torch.bfloat16) * 2 == f32
