"""The paired statistics against textbook cases: McNemar's exact test and Newcombe's paired
interval on the two worked examples of Fagerland, Lydersen and Laake (Statistical Analysis of
Contingency Tables, ch. 8: Bentur et al. 2009, Cavo et al. 2012), the sign-flip test by hand
and against McNemar, Wilson's interval, and the bootstrap's coverage on a known case."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from specserve.bench.stats import (bootstrap_ci, geometric_mean, geometric_mean_ci,
                                   mcnemar_exact, newcombe_paired, sign_flip_p, wilson)


def test_mcnemar_exact_on_the_textbook_examples():
    # Bentur et al. (2009): 1 and 7 discordant pairs; exact conditional p = 0.070
    assert mcnemar_exact(1, 7) == pytest.approx(18 / 256)
    assert round(mcnemar_exact(1, 7), 3) == 0.070
    # Cavo et al. (2012): 6 and 16 discordant pairs; exact conditional p = 0.052
    assert round(mcnemar_exact(6, 16), 3) == 0.052
    tail = sum(math.comb(22, i) for i in range(7)) / 2**22
    assert mcnemar_exact(6, 16) == pytest.approx(2 * tail)


def test_mcnemar_exact_edge_cases_and_against_the_binomial_test():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == mcnemar_exact(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_exact(5, 5) == 1.0
    for b, c in itertools.product(range(12), repeat=2):
        if b + c:
            assert mcnemar_exact(b, c) == pytest.approx(sps.binomtest(b, b + c, 0.5).pvalue)
    with pytest.raises(ValueError, match="discordant"):
        mcnemar_exact(-1, 2)


def test_newcombe_paired_interval_on_the_textbook_example():
    # Cavo et al. (2012), ch. 8 of the book: estimate -0.0621, 95% CI -0.1186 to -0.0046
    lo, hi = newcombe_paired(59, 6, 16, 80)
    assert (round(lo, 4), round(hi, 4)) == (-0.1186, -0.0046)


def test_newcombe_paired_interval_properties():
    lo, hi = newcombe_paired(10, 0, 0, 10)  # no discordant pair: 0 inside, not a point
    assert lo < 0 < hi
    lo, hi = newcombe_paired(0, 20, 0, 0)  # every pair discordant one way
    assert hi == 1.0 and 0 < lo < 1
    for a, b, c, d in [(30, 2, 9, 5), (5, 9, 2, 30), (12, 3, 3, 12)]:
        lo, hi = newcombe_paired(a, b, c, d)
        assert lo <= (b - c) / (a + b + c + d) <= hi
    assert newcombe_paired(30, 2, 9, 5) == pytest.approx(tuple(-x for x in
                                                               newcombe_paired(30, 9, 2, 5)[::-1]))


def test_wilson_interval_known_values():
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(0, 0) == (0.0, 1.0)


def test_sign_flip_test_by_hand_and_equal_to_mcnemar_on_binary_differences():
    # d = (0.5, 0.5, -0.25): of the 8 sign flips, 4 reach |sum| >= 0.75
    assert sign_flip_p([0.5, 0.5, -0.25, 0.0]) == pytest.approx(0.5)
    assert sign_flip_p([0.0, 0.0]) == 1.0
    binary = [1.0] * 7 + [-1.0] + [0.0] * 20
    assert sign_flip_p(binary) == mcnemar_exact(7, 1)
    # the Monte Carlo branch (18 nonzero differences) against full enumeration
    d = np.random.default_rng(3).normal(0.2, 0.5, size=18)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=18)))
    exact = float(np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-9))
    assert sign_flip_p(d) == pytest.approx(exact, abs=0.005)


def test_bootstrap_interval_covers_a_known_geometric_mean_at_its_level():
    """Per-item log-ratios ~ N(log 1.2, 0.3^2), 30 items: the 95% interval of the geometric
    mean covers 1.2 in 91-98% of 400 fixed-seed replications."""
    rng = np.random.default_rng(11)
    covered = 0
    for rep in range(400):
        ratios = np.exp(rng.normal(math.log(1.2), 0.3, size=30))
        lo, hi = geometric_mean_ci(ratios, resamples=2000, seed=rep)
        covered += lo <= 1.2 <= hi
        assert lo <= geometric_mean(ratios) <= hi
    assert 0.91 <= covered / 400 <= 0.98


def test_bootstrap_is_reproducible_and_resamples_rows_together():
    x = np.arange(20.0)
    assert bootstrap_ci(x) == bootstrap_ci(x)  # the fixed seed
    pairs = np.stack([x, x], 1)  # [n, 2]: the two columns move together
    lo, hi = bootstrap_ci(pairs, lambda s: s[..., 0].mean(1) - s[..., 1].mean(1))
    assert lo == hi == 0.0
    with pytest.raises(ValueError, match="at least one item"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="positive"):
        geometric_mean([1.0, 0.0])
