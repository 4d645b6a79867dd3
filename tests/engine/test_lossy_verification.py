"""The engine's dispatch to the lossy rules, end to end with bigram toy models: the
entropy-aware budget follows its exact law (and D = 0 the lossless one), FLy with no room for
its window is lossless, and FLy with room moves the law and keeps more drafts (both variants)."""

from __future__ import annotations

from collections import Counter

import math

import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling.params import SamplingParams
from tests import toy

VOCAB, N_TOKENS, K, SAMPLES = 3, 4, 2, 6000
ALPHA = 1e-3
P = toy.random_table(VOCAB, seed=1)
Q = toy.random_table(VOCAB, seed=2, concentration=0.3)


def run(samples: int, seed: int, **lossy) -> tuple[Counter, object]:
    engine = toy.toy_engine(P, Q, K)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=N_TOKENS, ignore_eos=True,
                            seed=seed, **lossy)
    engine.add_request([0, 1], params)
    (out,) = toy.run_all(engine)
    return Counter(tuple(c.token_ids) for c in out.outputs), engine.metrics.total


def chi_square_p(counts: Counter, law: dict) -> float:
    keys = sorted(law)
    observed = [counts.get(s, 0) for s in keys]
    assert sum(observed) == sum(counts.values()), "engine produced a sequence of zero probability"
    return chisquare(observed, [law[s] * sum(observed) for s in keys]).pvalue


def top3_entropy(p: torch.Tensor) -> float:
    """h_3 written out for a 3-token row: -sum r log r / log 3."""
    r = (p / p.sum()).tolist()
    return -sum(x * math.log(x) for x in r if x > 0) / math.log(3)


def lossless_law() -> dict:
    return toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K, budget=0.0)


def test_entropy_budget_follows_its_exact_law_and_spends_less_than_the_flat_one():
    budget = 0.4
    counts, metrics = run(SAMPLES, 11, tv_budget=budget, tv_entropy_top_k=3)
    law = toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K,
                                  budget=lambda p: budget * top3_entropy(p))
    assert chi_square_p(counts, law) > ALPHA
    assert chi_square_p(counts, lossless_law()) < ALPHA  # the shaped budget was spent
    _, flat = run(SAMPLES, 11, tv_budget=budget)
    assert 0 < metrics.tv_sum / metrics.tv_steps <= budget
    assert metrics.tv_sum / metrics.tv_steps < flat.tv_sum / flat.tv_steps


def test_entropy_budget_zero_is_lossless_through_the_engine():
    counts, metrics = run(SAMPLES, 12, tv_budget=0.0, tv_entropy_top_k=3)
    assert chi_square_p(counts, lossless_law()) > ALPHA
    assert metrics.tv_sum == 0.0


def test_fly_without_room_for_its_window_is_lossless_through_the_engine():
    counts, _ = run(SAMPLES, 13, fly_window=K, fly_entropy_threshold=0.0)
    assert chi_square_p(counts, lossless_law()) > ALPHA


def test_fly_with_room_moves_the_law_and_keeps_more_drafts():
    counts, fly = run(SAMPLES, 14, fly_window=1, fly_entropy_threshold=0.0)
    assert chi_square_p(counts, lossless_law()) < ALPHA
    _, lossless = run(SAMPLES, 14)
    assert fly.accepted / fly.drafted > lossless.accepted / lossless.drafted
    assert fly.tv_sum > 0  # its deferrals are reported as realised TV


def test_published_fly_without_room_is_lossless_and_with_room_keeps_more_drafts():
    # win_len = K: i + K < K never holds; win_len = 1 defers position 0 of K = 2 (gate at 0)
    counts, _ = run(SAMPLES, 15, fly_variant="published", fly_window=K, fly_entropy_threshold=0.0)
    assert chi_square_p(counts, lossless_law()) > ALPHA
    counts, fly = run(SAMPLES, 16, fly_variant="published", fly_window=1,
                      fly_entropy_threshold=0.0)
    assert chi_square_p(counts, lossless_law()) < ALPHA
    _, lossless = run(SAMPLES, 16)
    assert fly.accepted / fly.drafted > lossless.accepted / lossless.drafted


@pytest.mark.parametrize("lossy", [dict(fly_window=1, fly_entropy_threshold=0.0),
                                   dict(fly_variant="published", fly_window=1),
                                   dict(tv_budget=0.5, tv_entropy_top_k=3)])
def test_greedy_requests_with_a_lossy_rule_still_finish(lossy):
    engine = toy.toy_engine(P, Q, K)
    engine.add_request([0, 1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                              **lossy))
    (out,) = toy.run_all(engine)
    assert len(out.outputs[0].token_ids) == 8


def greedy_tokens(**lossy) -> list[int]:
    engine = toy.toy_engine(P, Q, K)
    engine.add_request([0, 1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                              **lossy))
    (out,) = toy.run_all(engine)
    return out.outputs[0].token_ids


def test_greedy_with_the_lossy_rules_disabled_is_greedy_token_for_token():
    plain = greedy_tokens()
    assert greedy_tokens(fly_window=K, fly_entropy_threshold=0.0) == plain
    assert greedy_tokens(tv_budget=0.0, tv_entropy_top_k=3) == plain
