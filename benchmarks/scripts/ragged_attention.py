"""One layer's attention, native ragged kernel (`specserve.models.attention.ragged_attention`)
against the paths it replaces, side by side in one process on 2 threads; medians over rounds
that run every implementation in turn.

(a) decode/verify: 8 sequences × 5 rows each at a 1,000-token context (12 query heads on 2 KV
    heads, hd 128, as the 1.5B target): the per-position loop (one SDPA call per row on the
    slot cache, the transformer's path up to 64 rows before ragged attention), one dense masked SDPA over the batch (today's path above
    64 rows, including the slot cache gather) and the ragged kernel on a block pool;
(b) prefill: one chunk of 512 and of 900 rows attending causally from position 0: masked SDPA
    (today's prefill path) against the ragged kernel.

    python benchmarks/scripts/ragged_attention.py [rounds] [threads]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.models.attention import ragged_attention

HEADS, KV_HEADS, HD, BLOCK = 12, 2, 128, 16


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The per-position call the transformer made before ragged attention: q [1, heads, 1, hd]
    folded onto its KV heads, keys and values [1, kv, n, hd] read in place."""
    _, heads, _, hd = q.shape
    grouped = q.reshape(1, keys.shape[1], heads // keys.shape[1], hd)  # [1, kv, group, hd]
    return F.scaled_dot_product_attention(grouped, keys, values).reshape(1, heads, 1, hd)


def paged(keys: torch.Tensor, values: torch.Tensor, gen: torch.Generator):
    """Slot-cache keys/values [seqs, kv, n, hd] → pools [blocks, kv, BLOCK, hd] in shuffled blocks
    and block tables [seqs, n / BLOCK]."""
    seqs, kv, n, hd = keys.shape
    per = -(-n // BLOCK)
    order = torch.randperm(seqs * per, generator=gen)
    tables = order.reshape(seqs, per).int()  # [seqs, per]
    k_pool = torch.zeros(seqs * per, kv, BLOCK, hd)
    v_pool = torch.zeros_like(k_pool)
    pad = per * BLOCK - n
    for s in range(seqs):
        kb = F.pad(keys[s], (0, 0, 0, pad)).reshape(kv, per, BLOCK, hd).transpose(0, 1)
        vb = F.pad(values[s], (0, 0, 0, pad)).reshape(kv, per, BLOCK, hd).transpose(0, 1)
        k_pool[tables[s].long()], v_pool[tables[s].long()] = kb, vb
    return k_pool, v_pool, tables


def medians(impls: dict, rounds: int) -> dict[str, float]:
    samples = {name: [] for name in impls}
    for fn in impls.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1000 for name, s in samples.items()}


def decode_verify(rounds: int, seqs: int = 8, per_seq: int = 5, context: int = 1000) -> None:
    gen = torch.Generator().manual_seed(0)
    n = context + per_seq
    keys = torch.randn(seqs, KV_HEADS, n, HD, generator=gen)  # [seqs, kv, n, hd] slot cache
    values = torch.randn(seqs, KV_HEADS, n, HD, generator=gen)
    q = torch.randn(seqs, HEADS, per_seq, HD, generator=gen)  # [seqs, heads, T, hd]
    k_pool, v_pool, tables = paged(keys, values, gen)
    rows_q = q.transpose(1, 2).reshape(seqs * per_seq, HEADS, HD)  # [rows, heads, hd]
    row_seq = torch.arange(seqs).repeat_interleave(per_seq).int()
    row_pos = (context + torch.arange(per_seq)).repeat(seqs).int()
    slots = torch.arange(seqs)
    mask = (torch.arange(n)[None, :] <= row_pos[:per_seq, None])[None, None]  # [1, 1, T, n]

    def per_position():
        out = torch.zeros_like(q)
        for s in range(seqs):
            for t in range(per_seq):
                end = context + t + 1
                out[s:s + 1, :, t:t + 1] = attend_one(q[s:s + 1, :, t:t + 1],
                                                      keys[s:s + 1, :, :end], values[s:s + 1, :, :end])
        return out

    def dense():
        k, v = keys[slots], values[slots]  # the slot cache gather of KVCache.read
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def ragged():
        return ragged_attention(rows_q, k_pool, v_pool, tables, row_seq, row_pos)

    got = ragged().reshape(seqs, per_seq, HEADS, HD).transpose(1, 2)
    assert torch.allclose(got, per_position(), atol=1e-5) and torch.allclose(got, dense(), atol=1e-5)
    ms = medians({"per-position attend_one": per_position, "dense masked SDPA": dense,
                  "ragged kernel": ragged}, rounds)
    print(f"(a) {seqs} seqs x {per_seq} rows at context {context}, {HEADS}/{KV_HEADS} heads, hd {HD}:")
    for name, t in ms.items():
        print(f"    {name:26s} {t:8.2f} ms")


def prefill(rows: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    keys = torch.randn(1, KV_HEADS, rows, HD, generator=gen)  # [1, kv, T, hd]
    values = torch.randn(1, KV_HEADS, rows, HD, generator=gen)
    q = torch.randn(1, HEADS, rows, HD, generator=gen)  # [1, heads, T, hd]
    k_pool, v_pool, tables = paged(keys, values, gen)
    rows_q = q[0].transpose(0, 1).contiguous()  # [T, heads, hd]
    row_seq = torch.zeros(rows, dtype=torch.int32)
    row_pos = torch.arange(rows, dtype=torch.int32)
    mask = (torch.arange(rows)[None, :] <= torch.arange(rows)[:, None])[None, None]  # [1,1,T,T]

    def masked():
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def causal():
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)

    def ragged():
        return ragged_attention(rows_q, k_pool, v_pool, tables, row_seq, row_pos)

    assert torch.allclose(ragged(), masked()[0].transpose(0, 1), atol=1e-5)
    ms = medians({"masked SDPA": masked, "is_causal SDPA": causal, "ragged kernel": ragged},
                 rounds)
    print(f"(b) prefill {rows} rows causal, {HEADS}/{KV_HEADS} heads, hd {HD}:")
    for name, t in ms.items():
        print(f"    {name:26s} {t:8.2f} ms")


def main(rounds: int = 15, threads: int = 2) -> None:
    torch.set_num_threads(threads)
    print(f"{threads} threads, kernel built for {kernels.isa()}, medians of {rounds} rounds")
    assert kernels.attention() is not None, "native attention kernel unavailable here"
    decode_verify(rounds)
    for rows in (512, 900):
        prefill(rows, rounds)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
