"""The quality statistics on hand-made inputs."""

from __future__ import annotations

import math

import torch

from specserve.bench.quality import distinct_n, target_nll, token_nll
from tests.sampling.oracles import tv_distance


def test_token_nll_of_known_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    assert math.isclose(token_nll(logits, [0, 2]), -(math.log(0.5) + math.log(0.8)) / 2, rel_tol=1e-6)


def test_target_nll_scores_each_output_token_given_its_prefix():
    from tests import toy

    table = torch.tensor([[1.0, 3.0], [2.0, 2.0]])  # p(next | current)
    model = toy.BigramModel(table)
    got = target_nll(model, [0], [1, 1, 0])
    expected = -(math.log(0.75) + math.log(0.5) + math.log(0.5)) / 3
    assert math.isclose(got, expected, rel_tol=1e-6)


def test_tv_of_known_distributions():
    assert math.isclose(tv_distance(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])), 0.5)
    assert tv_distance(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])) == 0.0


def test_distinct_n_of_known_text():
    words = "the cat sat on the cat".split()
    assert distinct_n(words, 1) == 4 / 6
    assert distinct_n(words, 2) == 4 / 5  # (the,cat) repeats
    assert distinct_n(words, 3) == 1.0
    assert math.isnan(distinct_n(words[:2], 3))
