"""The summary's speedups on hand-made records."""

from __future__ import annotations

import statistics

import pytest

from specserve.bench.runner import summarize


def _rec(config: str, seed: int, rate: float) -> dict:
    spec = None if config == "target only" else {
        "drafted": 4, "accepted": 2, "emitted": 3, "rounds": 1, "k_histogram": {"4": 1}, "mean_tv": 0.0}
    return {"config": config, "temperature": 0.7, "workload": "w", "seed": seed, "repeat": 0,
            "e2e_s": 100.0 / rate, "ttft_s": 1.0, "decode_tokens_per_s": rate, "speculative": spec,
            "distinct_2": 0.5, "distinct_3": 0.5}


def test_paired_speedup_cancels_drift_between_rounds():
    """The machine runs 1.0, 0.7, 1.3 times as fast in the three rounds of the round robin, and
    the configuration is 0.98x target-only in each: the paired speedup says 0.98 exactly, the
    ratio of medians only roughly."""
    drift = [1.0, 0.7, 1.3]
    records = [_rec("target only", s, 10.0 * d) for s, d in enumerate(drift)]
    records += [_rec("cost_aware", s, 9.8 * d) for s, d in reversed(list(enumerate(drift)))]
    rows = {r["config"]: r for r in summarize(records)}
    assert rows["cost_aware"]["speedup_paired"] == pytest.approx(0.98)
    assert rows["target only"]["speedup_paired"] == pytest.approx(1.0)
    assert rows["cost_aware"]["speedup_decode"] == pytest.approx(0.98)  # the medians pair here
    # a sudden slowdown between two calls of round 0 pairs badly once, and only once
    records[-1] = _rec("cost_aware", 0, 9.8 * 0.7)
    records[0] = _rec("target only", 0, 10.0 * 1.6)
    rows = {r["config"]: r for r in summarize(records)}
    assert rows["cost_aware"]["speedup_paired"] == pytest.approx(statistics.median([0.98 * 0.7 / 1.6, 0.98, 0.98]))
    assert rows["cost_aware"]["speedup_decode"] != pytest.approx(0.98, abs=0.05)


def test_paired_speedup_is_none_without_a_target_only_call():
    rows = summarize([_rec("cost_aware", 0, 9.0)])
    assert rows[0]["speedup_paired"] is None and rows[0]["speedup_decode"] is None
