"""Tests for the normalized top-k entropy and the entropy-aware mentored budget: closed-form
values, the bounds D_i in [0, D] (D = 0 exact, a sure target exact), per-position budgets in
`verify`, and a chi-square fit that each position emits its own pi_i."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.sampling.entropy import entropy_budgets, gate_distribution, normalized_topk_entropy
from specserve.sampling.rejection import verify
from tests.sampling.oracles import mentored_distribution, tv_distance

ALPHA = 1e-3


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def random_rows(gen: torch.Generator, n: int, vocab: int, sharp: float = 1.0) -> torch.Tensor:
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * sharp
    return torch.softmax(logits, -1)  # [n, vocab]


def test_entropy_closed_form_values():
    rows = t64([[1.0, 0.0, 0.0, 0.0],            # one-hot: sure
                [0.25, 0.25, 0.25, 0.25],        # flat over the top 3: 1
                [0.5, 0.5, 0.0, 0.0],            # two of three: log 2 / log 3
                [0.0, 0.0, 0.0, 0.0]])           # no mass: 0
    h = normalized_topk_entropy(rows, 3)
    assert h.tolist() == pytest.approx([0.0, 1.0, math.log(2) / math.log(3), 0.0], abs=1e-12)
    # top-k renormalises: only the shape of the k best matters
    assert float(normalized_topk_entropy(t64([0.3, 0.3, 0.4 / 3, 0.4 / 3, 0.4 / 3]), 2)) == \
        pytest.approx(1.0, abs=1e-12)
    # k above the vocabulary uses the whole vocabulary
    assert float(normalized_topk_entropy(t64([0.5, 0.5]), 8)) == pytest.approx(1.0, abs=1e-12)


def test_entropy_rejects_top_k_below_two():
    with pytest.raises(ValueError, match="top_k"):
        normalized_topk_entropy(t64([0.5, 0.5]), 1)


def test_entropy_budget_never_exceeds_request_budget_and_spends_it_where_uncertain():
    gen = torch.Generator().manual_seed(0)
    for sharp in (0.1, 1.0, 5.0, 30.0):
        rows = random_rows(gen, 200, 16, sharp)
        for budget in (0.0, 0.1, 0.5, 1.0):
            d = entropy_budgets(rows, budget, 4)
            assert len(d) == 200 and all(0.0 <= x <= budget for x in d)
            h = normalized_topk_entropy(rows, 4).tolist()
            assert d == pytest.approx([budget * x for x in h], abs=1e-15)
    sure, flat = t64([[1.0, 0, 0, 0]]), t64([[0.25] * 4])
    assert entropy_budgets(sure, 0.8, 4) == [0.0]          # a sure target is verified exactly
    assert entropy_budgets(flat, 0.8, 4) == pytest.approx([0.8])  # a hesitant one gets all of D
    assert entropy_budgets(random_rows(gen, 5, 8), 0.0, 3) == [0.0] * 5  # D = 0: exactly 0


def test_entropy_budget_zero_is_exactly_the_lossless_rule():
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        k = int(torch.randint(1, 5, (), generator=gen))
        target, draft = random_rows(gen, k + 1, 6, 2.0), random_rows(gen, k, 6, 2.0)
        x = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        u = torch.rand(k, generator=gen, dtype=torch.float64).tolist()
        r = float(torch.rand((), generator=gen, dtype=torch.float64))
        budgets = entropy_budgets(target[:k], 0.0, 3)
        assert verify(x, draft, target, u, r, budgets) == verify(x, draft, target, u, r, 0.0)


def test_per_position_budgets_bound_the_realised_tv():
    gen = torch.Generator().manual_seed(2)
    for _ in range(300):
        k = 4
        target, draft = random_rows(gen, k + 1, 6, 2.0), random_rows(gen, k, 6, 2.0)
        x = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        u = torch.rand(k, generator=gen, dtype=torch.float64).tolist()
        budgets = entropy_budgets(target[:k], 0.6, 3)
        out = verify(x, draft, target, u, 0.5, budgets)
        for i, tv in enumerate(out.tv_distances):
            assert tv <= budgets[i] + 1e-12
            assert tv == pytest.approx(min(budgets[i], tv_distance(target[i], draft[i])), abs=1e-12)


def test_per_position_budgets_are_checked():
    x, target = torch.tensor([0, 1]), t64([[0.5, 0.5]] * 3)
    with pytest.raises(ValueError, match="tv_budget"):
        verify(x, None, target, [0.1, 0.1], 0.5, [0.2])
    with pytest.raises(ValueError, match="tv_budget"):
        verify(x, None, target, [0.1, 0.1], 0.5, [0.2, 1.5])
    with pytest.raises(ValueError, match="tv_budget"):
        entropy_budgets(target, -0.1, 3)


def test_each_position_emits_its_own_mentored_law_chi_square():
    """Rows fixed per position, budgets D_0 != D_1: the first token is distributed as pi_0
    (budget D_0) and the second, when emitted, as pi_1 (budget D_1)."""
    p = t64([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    q = t64([[0.1, 0.1, 0.2, 0.6], [0.7, 0.1, 0.1, 0.1]])
    budgets = [0.1, 0.4]
    pis = [mentored_distribution(p[i], q[i], budgets[i]).numpy() for i in range(2)]
    rng = np.random.default_rng(3)
    counts = [np.zeros(4), np.zeros(4)]
    n = 40_000
    xs = np.stack([rng.choice(4, size=n, p=q[i].numpy()) for i in range(2)], 1)
    us = rng.random((n, 3))
    for j in range(n):
        out = verify(torch.tensor(xs[j]), q, p, us[j, :2].tolist(), float(us[j, 2]), budgets)
        for i, token in enumerate(out.tokens[:2]):
            counts[i][token] += 1
    for i in range(2):
        assert stats.chisquare(counts[i], counts[i].sum() * pis[i]).pvalue > ALPHA


def test_gate_distribution_reads_raw_logits_when_greedy():
    logits = t64([[2.0, 1.0, 0.0]])
    one_hot = t64([[1.0, 0.0, 0.0]])
    assert gate_distribution(logits, one_hot, greedy=False) is one_hot
    assert torch.allclose(gate_distribution(logits, one_hot, greedy=True).double(),
                          torch.softmax(logits, -1), atol=1e-6)
