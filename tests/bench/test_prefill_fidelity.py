"""The prefill fidelity report's arithmetic: |Δ log p| over the reference's top tokens, and
top-1 agreement, on a tiny model's paths."""

from __future__ import annotations

import torch

from specserve.bench.prefill_fidelity import compare, log_probs, scorer, summary
from specserve.models.prefill import NATIVE, ONEDNN
from specserve.weights.loader import load_model
from tests import tiny


def test_a_side_equal_to_the_reference_scores_zero_and_another_does_not(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path / "m")
    ids = list(range(3, 60))
    reference = log_probs(scorer(load_model(path, "float32", weights="float32").model,
                                 NATIVE, 64), ids)
    int4 = load_model(path, "float32", weights="int4").model
    same = summary([compare(reference, reference)])
    assert same["max"] == 0 and same["top1_agreement"] == 1 and same["pairs"] == 5 * len(ids)
    for choice in (NATIVE, ONEDNN):
        scored = summary([compare(reference, log_probs(scorer(int4, choice, 64), ids))])
        assert 0 < scored["mean"] <= scored["p99"] <= scored["max"] < 1


def test_the_deltas_are_over_the_references_top_tokens():
    ref = torch.log_softmax(torch.tensor([[5.0, 4, 3, 2, 1, 0, -9]]), -1)
    got = ref.clone()
    got[0, 6] += 3.0  # outside the reference's top 5: not counted
    assert summary([compare(ref, got)])["max"] == 0
    got[0, 4] -= 0.5  # inside
    assert summary([compare(ref, got)])["max"] == 0.5
