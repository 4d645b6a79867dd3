"""Peer rows are compared with the first of our configurations that the run holds, on the
same workload and temperature: decode rate, TTFT and end-to-end time."""

from __future__ import annotations

import pytest

from specserve.bench.peers import MATCHES, attach_ratios
from specserve.bench.report import peer_table


def _ours(config: str, rate: float, ttft: float, e2e: float) -> dict:
    return {"config": config, "workload": "code_edit", "temperature": 0.0,
            "decode_tokens_per_s": rate, "median_ttft_s": ttft, "median_e2e_s": e2e}


def test_prompt_lookup_is_compared_with_ngram_cost_aware_first():
    ours = [_ours("target only", 30.0, 6.0, 14.0), _ours("ngram k=4", 40.0, 6.0, 12.0),
            _ours("ngram cost-aware", 50.0, 5.0, 10.0)]
    peer = {"engine": "llama.cpp", "config": "prompt lookup", "temperature": 0.0,
            "workload": "code_edit", "ttft_s": 4.0, "decode_tokens_per_s": 40.0,
            "median_e2e_s": 12.0, "matches": MATCHES["prompt lookup"]}
    other = dict(peer, workload="creative")
    attach_ratios([peer, other], ours)
    assert peer["matched"] == "ngram cost-aware"
    assert peer["ours_over_theirs"] == pytest.approx(1.25)
    assert peer["ttft_ours_over_theirs"] == pytest.approx(1.25)
    assert peer["e2e_speedup"] == pytest.approx(1.2)
    assert other["matched"] is None and other["e2e_speedup"] is None
    table = peer_table([peer, other])
    assert "| ngram cost-aware | 1.25x | 1.25x | 1.20x |" in table
    assert table.count("\n") == 3
