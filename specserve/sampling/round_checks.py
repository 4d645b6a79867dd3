"""Checks of one verify call's inputs: the round's shapes, the uniforms, the TV budgets.

Every verifier of `sampling/` (`rejection.py`, `fly.py`) validates through these, so they
word their errors the same way: a ValueError naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_tv_budget(tv_budget: float) -> None:
    if not 0.0 <= tv_budget <= 1.0:  # also rejects NaN
        raise ValueError(f"tv_budget must be in [0, 1], got {tv_budget}")


def check_budgets(tv_budget: float | Sequence[float], k: int) -> list[float]:
    """One budget per draft position: a single D repeated k times, or k budgets each in [0, 1]."""
    if isinstance(tv_budget, (int, float)) and not isinstance(tv_budget, bool):
        check_tv_budget(float(tv_budget))
        return [float(tv_budget)] * k
    budgets = [float(b) for b in tv_budget]
    if len(budgets) != k:
        raise ValueError(f"tv_budget must be one number or k = {k} budgets, got {len(budgets)}")
    for b in budgets:
        check_tv_budget(b)
    return budgets


def check_uniform(uniform: float | Tensor, name: str) -> float:
    u = float(uniform)
    if not 0.0 <= u < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {u}")
    return u


def check_uniforms(uniforms: Tensor | list[float], k: int) -> list[float]:
    us = uniforms.tolist() if isinstance(uniforms, Tensor) else list(uniforms)
    if not isinstance(us, list) or len(us) != k:
        raise ValueError(f"uniforms must hold k = {k} draws, got {len(us)}")
    if not all(0.0 <= u < 1.0 for u in us):
        raise ValueError(f"uniforms must lie in [0, 1), got {us}")
    return us


def check_round(draft_tokens: Tensor, target_probs: Tensor) -> list[int]:
    """Validate a round's shapes; the draft tokens as a list."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [k], got shape {tuple(draft_tokens.shape)}")
    if not is_integer(draft_tokens):
        raise ValueError(f"draft_tokens must be integer, got {draft_tokens.dtype}")
    drafts = draft_tokens.tolist()
    k = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have shape [k + 1, vocab] = [{k + 1}, vocab], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if not all(0 <= x < vocab for x in drafts):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {drafts}")
    return drafts


def is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_draft_probs(draft_probs: Tensor | None, target_probs: Tensor, k: int) -> None:
    if draft_probs is None:
        return
    expected = (k, target_probs.shape[1])
    if tuple(draft_probs.shape) != expected:
        raise ValueError(f"draft_probs must have shape {list(expected)}, "
                         f"got {tuple(draft_probs.shape)}")


def check_verify_args(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                      uniforms: Tensor | list[float], residual_uniform: float,
                      tv_budget: float | Sequence[float]
                      ) -> tuple[list[int], list[float], list[float], float]:
    """Every input check of a verify call: (drafts, budgets, uniforms, residual uniform)."""
    drafts = check_round(draft_tokens, target_probs)
    k = len(drafts)
    budgets = check_budgets(tv_budget, k)
    check_draft_probs(draft_probs, target_probs, k)
    return drafts, budgets, check_uniforms(uniforms, k), check_uniform(residual_uniform,
                                                                       "residual_uniform")
