"""Ragged paged attention (`specserve/models/attention.py`, kernel `specserve/kernels/attention.c`):
accuracy against the per-row SDPA oracle and a dense masked SDPA, and bit-for-bit batch
invariance (a row's output never depends on the other rows, their order, the pool's other
sequences, the thread count or the block size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.models import attention
from specserve.models.attention import ragged_attention, ragged_attention_reference

ATOL = RTOL = 1e-5  # float32 throughout; observed errors are below 1e-6


def make_sequences(lengths: list[int], kv_heads: int, hd: int, seed: int):
    """Logical keys and values of each sequence: lists of [kv_heads, length, hd]."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(kv_heads, n, hd, generator=g) for n in lengths]
    values = [torch.randn(kv_heads, n, hd, generator=g) for n in lengths]
    return keys, values


def paged(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, seed: int,
          spare_blocks: int = 3):
    """Pools [num_blocks, kv, block_size, hd] holding the sequences in shuffled blocks (plus
    `spare_blocks` unused), and block tables [num_seqs, max_blocks]. Every position no sequence
    holds (block tails, spare blocks) is NaN, so reading one would show."""
    kv_heads, _, hd = keys[0].shape
    per = [-(-k.shape[1] // block_size) for k in keys]
    total = sum(per) + spare_blocks
    ids = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    k_pool = torch.full((total, kv_heads, block_size, hd), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    tables = torch.full((len(keys), max(per)), -1, dtype=torch.int32)
    used = 0
    for s, (k, v) in enumerate(zip(keys, values)):
        n = k.shape[1]
        for b in range(per[s]):
            block = int(ids[used])
            used += 1
            tables[s, b] = block
            lo, hi = b * block_size, min(n, (b + 1) * block_size)
            k_pool[block, :, :hi - lo] = k[:, lo:hi]
            v_pool[block, :, :hi - lo] = v[:, lo:hi]
    return k_pool, v_pool, tables


def dense_attention(q: torch.Tensor, keys, values, row_seq: torch.Tensor, row_pos: torch.Tensor):
    """One masked `scaled_dot_product_attention` per sequence over all of its rows, on dense
    keys/values: the way a prefill pass attends."""
    out = torch.empty_like(q)
    for s in row_seq.unique().tolist():
        rows = (row_seq == s).nonzero().flatten()
        k, v = keys[s][None], values[s][None]  # [1, kv, n, hd]
        mask = torch.arange(k.shape[2])[None, :] <= row_pos[rows].long()[:, None]  # [T, n]
        qs = q[rows].transpose(0, 1)[None]  # [1, heads, T, hd]
        got = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], enable_gqa=True)
        out[rows] = got[0].transpose(0, 1)
    return out


def ragged_batch(heads: int, hd: int, lengths: list[int], rows_of: list[list[int]], seed: int):
    """Queries [rows, heads, hd], row_seq and row_pos for rows at the given positions of each
    sequence (rows_of[s] = positions of sequence s)."""
    g = torch.Generator().manual_seed(seed + 1)
    row_seq = torch.tensor([s for s, ps in enumerate(rows_of) for _ in ps], dtype=torch.int32)
    row_pos = torch.tensor([p for ps in rows_of for p in ps], dtype=torch.int32)
    assert all(p < lengths[s] for s, p in zip(row_seq.tolist(), row_pos.tolist()))
    q = torch.randn(len(row_seq), heads, hd, generator=g)
    return q, row_seq, row_pos


# A pass mixing every shape: a decode row at position 0, a verify run, a long prefill chunk
# reaching far into the sequence, a decode row on a long context, a short prefill.
LENGTHS = [1, 40, 700, 333, 9]
ROWS_OF = [[0], list(range(33, 40)), list(range(600, 700, 7)), [332], list(range(9))]


def test_kernel_builds_here():
    """CI runs on x86-64 with AVX2 and a C compiler: the native path must be the one tested."""
    assert kernels.cpu_supported()
    assert kernels.attention() is not None


@pytest.mark.parametrize("heads, kv_heads, hd", [
    (4, 2, 16),  # the tiny test models
    (4, 2, 64), (8, 8, 64), (9, 3, 64), (14, 2, 64),
    (12, 2, 128),  # qwen2.5 1.5B
    (16, 2, 24),  # 8 query heads per KV head, hd not a multiple of 16
])
def test_matches_reference_and_dense_sdpa(heads, kv_heads, hd):
    keys, values = make_sequences(LENGTHS, kv_heads, hd, seed=heads * 100 + hd)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=hd)
    q, row_seq, row_pos = ragged_batch(heads, hd, LENGTHS, ROWS_OF, seed=heads)
    got = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos)
    assert got.shape == q.shape and got.dtype == torch.float32
    ref = ragged_attention_reference(q, k_pool, v_pool, tables, row_seq, row_pos)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    dense = dense_attention(q, keys, values, row_seq, row_pos)
    torch.testing.assert_close(got, dense, atol=ATOL, rtol=RTOL)


def test_a_pass_without_rows_returns_an_empty_result():
    keys, values = make_sequences([5], 2, 16, seed=4)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=4)
    none = torch.zeros(0, dtype=torch.int32)
    for fn in (ragged_attention, ragged_attention_reference):
        out = fn(torch.zeros(0, 4, 16), k_pool, v_pool, tables, none, none)
        assert out.shape == (0, 4, 16)


def test_explicit_scale_and_large_scores_match_reference():
    """Scores in the hundreds: the softmax subtracts the maximum, nothing overflows."""
    keys, values = make_sequences([300], 2, 64, seed=5)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=5)
    q, row_seq, row_pos = ragged_batch(4, 64, [300], [[0, 150, 299]], seed=5)
    for scale in (0.5, 30.0):
        got = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos, scale=scale)
        ref = ragged_attention_reference(q, k_pool, v_pool, tables, row_seq, row_pos, scale=scale)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_positions_after_a_row_never_leak_into_it():
    """Two rows of one sequence far apart in one call: the early row must not read the later
    positions, even when they hold NaN (stale or unwritten cache)."""
    keys, values = make_sequences([300], 2, 32, seed=6)
    keys[0][:, 4:299], values[0][:, 4:299] = float("nan"), float("nan")
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=6)
    q, row_seq, row_pos = ragged_batch(4, 32, [300], [[3, 299]], seed=6)
    got = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos)
    assert torch.isfinite(got[0]).all()
    ref = ragged_attention_reference(q[:1], k_pool, v_pool, tables, row_seq[:1], row_pos[:1])
    torch.testing.assert_close(got[:1], ref, atol=ATOL, rtol=RTOL)


# 16 rows: a 9-row prefill chunk (more than one work item's rows), a verify run, decode rows,
# a row at position 0.
INV_LENGTHS = [500, 60, 1, 130, 45]
INV_ROWS = [list(range(480, 489)), list(range(55, 60)), [0], [129]]


@pytest.mark.parametrize("heads, kv_heads, hd", [(4, 2, 16), (12, 2, 128), (8, 8, 64)])
def test_each_row_bit_identical_in_any_batch(heads, kv_heads, hd):
    """A row's output is the same bits alone, in the batch of 16, permuted, with unrelated
    sequences in the pool, on 1 and 2 threads, and with block sizes 16, 32 and 7."""
    keys, values = make_sequences(INV_LENGTHS, kv_heads, hd, seed=hd)
    rows_of = INV_ROWS + [[]]
    q, row_seq, row_pos = ragged_batch(heads, hd, INV_LENGTHS, rows_of, seed=hd)
    assert len(q) == 16
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos)
        torch.set_num_threads(2)
        assert torch.equal(ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos), batch)
        for r in range(len(q)):
            alone = ragged_attention(q[r:r + 1], k_pool, v_pool, tables, row_seq[r:r + 1],
                                     row_pos[r:r + 1])
            assert torch.equal(alone[0], batch[r]), f"row {r} alone"
        perm = torch.randperm(len(q), generator=torch.Generator().manual_seed(2))
        permuted = ragged_attention(q[perm], k_pool, v_pool, tables, row_seq[perm], row_pos[perm])
        assert torch.equal(permuted, batch[perm])
        # the same sequences behind two unrelated ones, in other blocks of a bigger pool
        extra_k, extra_v = make_sequences([90, 700], kv_heads, hd, seed=3)
        k2, v2, t2 = paged(extra_k + keys, extra_v + values, block_size=16, seed=4)
        assert torch.equal(ragged_attention(q, k2, v2, t2, row_seq + 2, row_pos), batch)
        for block_size in (32, 7):
            kb, vb, tb = paged(keys, values, block_size=block_size, seed=block_size)
            assert torch.equal(ragged_attention(q, kb, vb, tb, row_seq, row_pos), batch)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("heads", [12, 6])  # 6 query heads per KV head, and 3 (an odd count)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 24])  # 24: an odd number of 8-wide chunks
def test_every_instruction_set_build_gives_the_same_bits(monkeypatch, heads, dtype, hd):
    """Every build is checked against the SDPA reference (the kernel has no bit-exact one; a
    CPU with one build still checks it), and all builds give the same bits, for every pool
    element kind and for a number of query heads per KV head that does not pair up."""
    keys, values = make_sequences(LENGTHS, 2, hd, seed=12)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=12)
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    q, row_seq, row_pos = ragged_batch(heads, hd, LENGTHS, ROWS_OF, seed=12)
    ref = ragged_attention_reference(q, k_pool.float(), v_pool.float(), tables, row_seq, row_pos)
    outs, build_for = [], kernels.attention
    for name in kernels.available_isas():
        monkeypatch.setattr(attention.kernels, "attention", lambda: build_for(name))
        assert attention.kernels.attention() is not None, name
        outs.append(ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos))
        torch.testing.assert_close(outs[-1], ref, atol=ATOL, rtol=RTOL)
    assert len(outs) >= 1 and all(torch.equal(o, outs[0]) for o in outs)


def test_prefill_chunk_above_64_rows_equals_decoding_row_by_row():
    """A 150-row prefill chunk (the size that used to switch to a masked, non-invariant path)
    gives every row the bits a one-row decode step at that position gives."""
    keys, values = make_sequences([160], 2, 64, seed=8)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=8)
    q, row_seq, row_pos = ragged_batch(4, 64, [160], [list(range(10, 160))], seed=8)
    chunk = ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos)
    for r in range(len(q)):
        step = ragged_attention(q[r:r + 1], k_pool, v_pool, tables, row_seq[r:r + 1],
                                row_pos[r:r + 1])
        assert torch.equal(step[0], chunk[r]), f"row {r}"


def test_falls_back_to_the_reference_without_the_kernel(monkeypatch):
    """hd not a multiple of 8, or no native kernel (SPECSERVE_NO_NATIVE, an older CPU): the
    reference's result, exactly."""
    keys, values = make_sequences([50, 20], 2, 12, seed=9)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=9)
    q, row_seq, row_pos = ragged_batch(4, 12, [50, 20], [[0, 49], [19]], seed=9)
    ref = ragged_attention_reference(q, k_pool, v_pool, tables, row_seq, row_pos)
    assert torch.equal(ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos), ref)

    keys, values = make_sequences([50], 2, 16, seed=10)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=10)
    q, row_seq, row_pos = ragged_batch(4, 16, [50], [[7, 49]], seed=10)
    ref = ragged_attention_reference(q, k_pool, v_pool, tables, row_seq, row_pos)
    monkeypatch.setattr(attention.kernels, "attention", lambda: None)
    assert torch.equal(ragged_attention(q, k_pool, v_pool, tables, row_seq, row_pos), ref)


@pytest.mark.parametrize("fn", [ragged_attention, ragged_attention_reference])
def test_bad_input_raises_value_error_naming_the_field(fn):
    keys, values = make_sequences([40], 2, 16, seed=11)
    k_pool, v_pool, tables = paged(keys, values, block_size=16, seed=11)
    q, row_seq, row_pos = ragged_batch(4, 16, [40], [[5, 39]], seed=11)
    with pytest.raises(ValueError, match="q"):
        fn(q.double(), k_pool, v_pool, tables, row_seq, row_pos)
    with pytest.raises(ValueError, match="k_pool"):
        fn(q[:, :3], k_pool, v_pool, tables, row_seq, row_pos)  # 3 heads on 2 KV heads
    with pytest.raises(ValueError, match="row_pos"):
        fn(q, k_pool, v_pool, tables, row_seq, row_pos[:1])
    with pytest.raises(ValueError, match="row_pos"):
        fn(q, k_pool, v_pool, tables, row_seq, torch.tensor([5, 48], dtype=torch.int32))
    with pytest.raises(ValueError, match="row_seq"):
        fn(q, k_pool, v_pool, tables, torch.tensor([0, 1], dtype=torch.int32), row_pos)
    bad = tables.clone()
    bad[0, 1] = k_pool.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        fn(q, k_pool, v_pool, bad, row_seq, row_pos)
