"""Our decoder against `transformers` on tiny random checkpoints, in float32."""

from __future__ import annotations

import torch

from specserve.weights.loader import load_model
from tests.slots import new_cache as slot_cache

TOL = 1e-4


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def ours(path):
    return load_model(path, dtype="float32").model


def test_prefill_logits_match_transformers(tiny_hf):
    hf_model, path = tiny_hf
    model = ours(path)
    ids = [5, 17, 33, 8, 90, 41, 3, 3, 12]
    cache = slot_cache(model, num_slots=2, max_len=64)
    (got,) = model.forward(cache.batch([ids], [0], [0]), cache.pool)
    assert (got - reference_logits(hf_model, ids)).abs().max() <= TOL


def test_decode_steps_match_transformers(tiny_hf):
    hf_model, path = tiny_hf
    model = ours(path)
    ids = [5, 17, 33, 8, 90]
    cache = slot_cache(model, num_slots=1, max_len=64)
    model.forward(cache.batch([ids[:2]], [0], [0]), cache.pool)
    ref = reference_logits(hf_model, ids)
    for pos in range(2, len(ids)):
        (got,) = model.forward(cache.batch([[ids[pos]]], [pos], [0]), cache.pool)
        assert (got[0] - ref[pos]).abs().max() <= TOL


def test_verify_pass_against_cached_prefix_matches_transformers(tiny_hf):
    hf_model, path = tiny_hf
    model = ours(path)
    prefix, draft = [5, 17, 33, 8, 90, 41], [3, 77, 12, 60, 9]  # k + 1 = 5 rows
    cache = slot_cache(model, num_slots=1, max_len=64)
    model.forward(cache.batch([prefix], [0], [0]), cache.pool)
    (got,) = model.forward(cache.batch([draft], [len(prefix)], [0]), cache.pool)
    ref = reference_logits(hf_model, prefix + draft)[len(prefix):]
    assert (got - ref).abs().max() <= TOL


def test_rollback_then_rewrite_gives_fresh_logits(tiny_hf):
    """Rejected draft positions are overwritten by the next pass: no stale keys leak in."""
    hf_model, path = tiny_hf
    model = ours(path)
    prefix = [5, 17, 33, 8]
    cache = slot_cache(model, num_slots=1, max_len=64)
    model.forward(cache.batch([prefix], [0], [0]), cache.pool)
    model.forward(cache.batch([[70, 71, 72, 73]], [4], [0]), cache.pool)  # rejected
    (got,) = model.forward(cache.batch([[11, 12]], [5], [0]), cache.pool)  # kept 70 only
    ref = reference_logits(hf_model, prefix + [70, 11, 12])[5:]
    assert (got - ref).abs().max() <= TOL


def test_ragged_batch_equals_each_sequence_alone(tiny_hf):
    hf_model, path = tiny_hf
    model = ours(path)
    seqs = [[5, 17, 33, 8, 90, 41, 3], [7, 7, 21], [60, 2, 44, 81, 19]]
    cache = slot_cache(model, num_slots=3, max_len=64)
    prefixes = [s[:-2] for s in seqs]
    slots = [2, 0, 1]
    model.forward(cache.batch([prefixes[0]], [0], [slots[0]]), cache.pool)
    model.forward(cache.batch(prefixes[1:], [0, 0], slots[1:]), cache.pool)
    # one ragged pass: a 2-token verify row, a 1-token decode row, a 2-token row
    rows = [seqs[0][-2:], seqs[1][-2:-1], seqs[2][-2:]]
    starts = [len(p) for p in prefixes]
    got = model.forward(cache.batch(rows, starts, slots), cache.pool)
    for seq, g, start, row in zip(seqs, got, starts, rows):
        ref = reference_logits(hf_model, seq[:start + len(row)])[start:]
        assert g.shape == ref.shape
        assert (g - ref).abs().max() <= TOL

