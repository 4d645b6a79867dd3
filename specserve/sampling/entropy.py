"""The target's uncertainty at a position, and a mentored TV budget spent where it is uncertain.

Normalized top-k entropy. For a distribution p over the vocabulary let t_1 >= ... >= t_m be
its m = min(k, vocab) largest probabilities and r_j = t_j / sum_j t_j. Then

    h_k(p) = -sum_j r_j log r_j / log m   in [0, 1],

0 when one token holds all of the top-k mass (the target is sure), 1 when its m best tokens
are equally likely (it hesitates among them). Looking at the top k only keeps h_k readable
on a 150k-token vocabulary, where the full entropy divided by log(vocab) is near 0 almost
everywhere; k is small (3 to 8): the question is "how many serious candidates are there".

Entropy-aware mentored budget. Mentored decoding (see `sampling/rejection.py`) lets
position i emit pi_i with TV(pi_i, p_i) <= D. The entropy-aware form gives position i the
budget

    D_i = D * h_k(p_i)  in [0, D],

so the budget is spent where the target hesitates among several tokens and not where it is
sure: a position with a one-hot p_i (h = 0) is verified exactly (D_i = 0), D = 0 is the
lossless rule at every position, and the realised TV theta_i d_i <= D_i <= D.

Under greedy decoding the processed p_i is a one-hot and has no entropy to read; the engine
then reads h_k from the softmax of the raw logits (see `gate_distribution`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specserve.sampling.round_checks import check_tv_budget


def normalized_topk_entropy(probs: Tensor, top_k: int) -> Tensor:
    """h_k of each row (float64 [n]); probs `[n, vocab]` (or one row `[vocab]`, giving [1])."""
    if top_k < 2:
        raise ValueError(f"top_k must be >= 2 (the entropy of one token is always 0), got {top_k}")
    rows = probs.reshape(-1, probs.shape[-1]).to(torch.float64)  # [n, vocab]
    m = min(top_k, rows.shape[1])
    if m < 2:
        return torch.zeros(rows.shape[0], dtype=torch.float64)  # [n]
    top = rows.topk(m, dim=-1).values  # [n, m]
    mass = top.sum(-1, keepdim=True)  # [n, 1]
    r = top / mass.clamp_min(1e-300)  # [n, m]
    terms = torch.where(r > 0, -r * r.clamp_min(1e-300).log(), torch.zeros_like(r))  # [n, m]
    h = terms.sum(-1) / math.log(m)  # [n]
    return torch.where(mass.squeeze(-1) > 0, h.clamp(0.0, 1.0), torch.zeros_like(h))


def entropy_budgets(probs: Tensor, tv_budget: float, top_k: int) -> list[float]:
    """D_i = D * h_k(p_i) for each row of `probs` ([k, vocab]): k budgets in [0, D]."""
    check_tv_budget(tv_budget)
    if tv_budget == 0.0:
        return [0.0] * probs.shape[0]
    h = normalized_topk_entropy(probs, top_k)  # [k]
    return [min(tv_budget, tv_budget * x) for x in h.tolist()]


def gate_distribution(logits: Tensor, target_probs: Tensor, greedy: bool) -> Tensor:
    """The distribution whose uncertainty a lossy rule reads: the processed target_probs when
    sampling; softmax of the raw logits when greedy, as the processed p is then a one-hot.
    logits and target_probs `[n, vocab]`; returns `[n, vocab]`."""
    if not greedy:
        return target_probs
    return torch.softmax(logits.to(torch.float32), dim=-1)  # [n, vocab]
