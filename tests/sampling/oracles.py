"""One step of the rejection sampler in closed form, over a whole vocabulary row: the laws the
tests compare `verify` against. Built from the sampler's own per-row pieces
(`specserve/sampling/rejection.py`: the mentor weight, the mix, the residual mass), so a test
of these functions is a test of the production math; `test_rejection.py` checks them against
an independent numpy reference."""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.sampling import rejection as R
from specserve.sampling.round_checks import check_tv_budget


def tv_distance(p: Tensor, q: Tensor) -> float:
    """Total-variation distance 1/2 sum|p - q| between two distributions over one vocabulary."""
    return float(R._tv_rows(R._f64(p), q))


def mentored_distribution(p: Tensor, q: Tensor, tv_budget: float) -> Tensor:
    """pi = (1 - theta) p + theta q, the distribution one mentored step emits (float64 [vocab])."""
    check_tv_budget(tv_budget)
    theta = R._mentor_weight(tv_distance(p, q), tv_budget)
    return R._mix(R._f64(p), R._f64(q), theta)


def per_token_acceptance(p: Tensor, q: Tensor, tv_budget: float = 0.0) -> Tensor:
    """a(x) = min(1, pi(x) / q(x)) for every token x (float64 [vocab]).

    A token the draft gave zero probability cannot have been sampled from q; should one be
    proposed anyway it is accepted if pi gives it mass and rejected otherwise.
    """
    pi = mentored_distribution(p, q, tv_budget)  # [vocab]
    q = R._f64(q)  # [vocab]
    ratio = torch.where(q > 0, pi / q, (pi > 0).to(pi.dtype))  # [vocab]
    return ratio.clamp_(max=1.0)


def acceptance_probability(p: Tensor, q: Tensor, tv_budget: float = 0.0) -> float:
    """Probability that a draft token x ~ q is accepted: 1 - max(0, TV(p, q) - D)."""
    check_tv_budget(tv_budget)
    return 1.0 - max(0.0, tv_distance(p, q) - tv_budget)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p - q, 0)), or p normalized where that has no mass (p == q); float64."""
    p = R._f64(p)  # [..., vocab]
    residual = R._residual_mass(p, q)  # [..., vocab]
    mass = residual.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, residual / mass.clamp_min(1e-300), p / p.sum(-1, keepdim=True))
