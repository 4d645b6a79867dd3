"""Per-request draft-length policies: how many tokens to draft in the next round.

Every policy answers `choose_k(max_k)` (0 ≤ k ≤ max_k, where the engine's `max_k` is the
room left: tokens to go, cache space) and learns from `observe(proposed, accepted)` after
each verify pass; `proposed` may be smaller than the k chosen (an n-gram drafter may find
fewer tokens, or none) and rounds with nothing proposed teach nothing. Every policy keeps
`histogram`, a count of the k it chose, for the metrics.

- `fixed`: always k.
- `acceptance_rate`: ±1 when the last round's accepted/proposed is ≥ 0.8 / < 0.4.
- `accepted_length`: EMA s ← 0.2·accepted + 0.8·s; propose round(s) + 1.
- `heuristic` (HF transformers' schedule): +2 after full acceptance, −1 otherwise.
- `cost_aware` (ours, `cost_aware.py`): maximise expected tokens per second with the
  engine's cost model.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol

from specserve.speculative.cost_aware import DEFAULT_MAX_K, CostAwarePolicy, StepCost

POLICY_NAMES = ("fixed", "acceptance_rate", "accepted_length", "heuristic", "cost_aware")
DEFAULT_MIN_K = 1


class DraftPolicy(Protocol):
    histogram: Counter[int]

    def choose_k(self, max_k: int) -> int:
        """k for the next round, 0 ≤ k ≤ max_k."""

    def observe(self, proposed: int, accepted: int) -> None:
        """The outcome of the round just verified (`proposed` may be 0)."""

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        """Whether to start the drafter (a draft model's prefill, `startup_s` seconds) for a
        sequence with `tokens_left` to generate. Only `cost_aware` weighs it; the others
        start whenever they draft at all."""


def _record(histogram: Counter[int], k: int) -> int:
    histogram[k] += 1
    return k


def _step_k(policy, proposed: int, step) -> None:
    """Move `policy.k` by `step()` within [min_k, max_k]; rounds that proposed nothing are ignored."""
    if proposed > 0:
        policy.k = min(policy.max_k, max(policy.min_k, policy.k + step()))


def _check_bounds(start_k: int, min_k: int, max_k: int) -> None:
    if min_k < 0:
        raise ValueError(f"min_k must be >= 0, got {min_k}")
    if max_k < min_k:
        raise ValueError(f"max_k must be >= min_k ({min_k}), got {max_k}")
    if not min_k <= start_k <= max_k:
        raise ValueError(f"start_k must be in [{min_k}, {max_k}], got {start_k}")


class FixedPolicy:
    """Always k (clipped by the engine's room)."""

    __slots__ = ("k", "histogram")

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k = k
        self.histogram: Counter[int] = Counter()

    def choose_k(self, max_k: int) -> int:
        return _record(self.histogram, min(self.k, max_k))

    def observe(self, proposed: int, accepted: int) -> None:
        pass

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        return self.k > 0


class AcceptanceRatePolicy:
    """k + 1 when the last round's accepted/proposed ≥ `high`, k − 1 when < `low`."""

    __slots__ = ("k", "low", "high", "min_k", "max_k", "histogram")

    def __init__(
        self,
        start_k: int,
        low: float = 0.4,
        high: float = 0.8,
        min_k: int = DEFAULT_MIN_K,
        max_k: int = DEFAULT_MAX_K,
    ) -> None:
        _check_bounds(start_k, min_k, max_k)
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"low must be in [0, high={high}] and high in [low, 1], got {low}")
        self.k, self.low, self.high, self.min_k, self.max_k = start_k, low, high, min_k, max_k
        self.histogram: Counter[int] = Counter()

    def choose_k(self, max_k: int) -> int:
        return _record(self.histogram, min(self.k, max_k))

    def observe(self, proposed: int, accepted: int) -> None:
        _step_k(self, proposed, lambda: 1 if accepted / proposed >= self.high
                else -1 if accepted / proposed < self.low else 0)

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        return self.max_k > 0


class AcceptedLengthPolicy:
    """Propose round(s) + 1 (halves round up), s ← ema·accepted + (1 − ema)·s."""

    __slots__ = ("smoothed", "ema", "min_k", "max_k", "histogram")

    def __init__(
        self,
        start_k: int,
        ema: float = 0.2,
        min_k: int = DEFAULT_MIN_K,
        max_k: int = DEFAULT_MAX_K,
    ) -> None:
        _check_bounds(start_k, min_k, max_k)
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        self.smoothed = float(start_k - 1)  # so the first round proposes start_k
        self.ema, self.min_k, self.max_k = ema, min_k, max_k
        self.histogram: Counter[int] = Counter()

    @property
    def k(self) -> int:
        return min(self.max_k, max(self.min_k, math.floor(self.smoothed + 0.5) + 1))

    def choose_k(self, max_k: int) -> int:
        return _record(self.histogram, min(self.k, max_k))

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self.smoothed = self.ema * accepted + (1.0 - self.ema) * self.smoothed

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        return self.max_k > 0


class HeuristicPolicy:
    """k + 2 after a round whose drafts were all accepted, k − 1 otherwise."""

    __slots__ = ("k", "min_k", "max_k", "histogram")

    def __init__(
        self, start_k: int, min_k: int = DEFAULT_MIN_K, max_k: int = DEFAULT_MAX_K
    ) -> None:
        _check_bounds(start_k, min_k, max_k)
        self.k, self.min_k, self.max_k = start_k, min_k, max_k
        self.histogram: Counter[int] = Counter()

    def choose_k(self, max_k: int) -> int:
        return _record(self.histogram, min(self.k, max_k))

    def observe(self, proposed: int, accepted: int) -> None:
        _step_k(self, proposed, lambda: 2 if accepted >= proposed else -1)

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        return self.max_k > 0


def make_policy(
    name: str, num_speculative_tokens: int, cost: StepCost | None, max_k: int = DEFAULT_MAX_K
) -> DraftPolicy:
    """The policy a request's config asks for.

    `num_speculative_tokens` is the fixed k, the starting k of the adaptive policies (bounds
    1..max(max_k, k)), or the cap of `cost_aware`; −1 (adaptive) selects `cost_aware` with
    cap `max_k` whatever the name; 0 disables speculation (always k = 0).
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"draft_policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
    k = num_speculative_tokens
    if k < -1:
        raise ValueError(f"num_speculative_tokens must be >= 0 or -1 (adaptive), got {k}")
    if k == 0 or (name == "fixed" and k > 0):
        return FixedPolicy(k)
    if k == -1 or name == "cost_aware":
        if cost is None:
            raise ValueError("draft_policy 'cost_aware' needs the engine's CostModel (cost=None)")
        return CostAwarePolicy(cost, max_k=max_k if k == -1 else k)
    upper = max(max_k, k)
    if name == "acceptance_rate":
        return AcceptanceRatePolicy(k, max_k=upper)
    if name == "accepted_length":
        return AcceptedLengthPolicy(k, max_k=upper)
    return HeuristicPolicy(k, max_k=upper)
