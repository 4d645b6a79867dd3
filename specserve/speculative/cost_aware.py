"""The cost-aware draft-length policy: the k with the most expected tokens per second,

    E(k) / T(k),   E(k) = 1 + Σ_{i=1..k} Π_{j≤i} α_j,   T(k) = step_time(k),

over k = 0..max_k, with α_j the request's recent per-position acceptance and T from the
engine's cost model. k = 0 is plain decoding; while at 0 it probes k = 1 now and then.
`worth_starting` decides whether a draft model's deferred prefill repays itself over the
tokens still to generate. Why: docs/design.md, "The cost-aware policy".
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Protocol

DEFAULT_MAX_K = 8  # the bound of the adaptive policies
DEFAULT_MARGIN = 0.08  # how much drafting must beat plain decoding by (estimated tokens/s)


class StepCost(Protocol):
    """What the policy reads of the engine's cost model."""

    def step_time(self, k: int) -> float:
        """Seconds of the step being planned at k drafts per sequence (k = 0: plain decoding)."""


class CostAwarePolicy:
    """Pick the k with the most expected tokens per second; k = 0 is plain decoding.

    Acceptance α_i (i = 1..max_k) comes from the last `window` rounds that proposed
    something: position i was *tried* in a round that proposed ≥ i tokens and accepted the
    i − 1 before it, and *accepted* if the round accepted ≥ i. Each α_i is shrunk toward the
    request's pooled rate (weight `prior_strength` pseudo-trials), and the pooled rate toward
    `prior_mean`, so a new request starts optimistic but one or two bad rounds weigh in, and
    positions rarely tried inherit the request's overall rate.

    Stopping is sticky (rounds at k = 0 teach nothing), so it must be confident: while
    speculating, the policy stops only if k = 0 also wins with every α_i raised by one
    posterior standard deviation. While stopped, every `probe interval` rounds (starting at
    `probe_every`, doubled after each probe that is not fully accepted, up to `probe_cap`)
    it drafts `probe_k` tokens anyway. A failed probe is one more round of evidence. A fully
    accepted one means the text may have changed: the older half of the window is dropped
    and the interval resets, so a few successes in a row bring speculation back, while one
    lucky probe on hostile text does not start a losing streak. Probes are cheap on purpose
    (k = 1, and the draft model catches up on only a few tokens: see `draft_model`); on
    hostile text they and the first rounds of a request are all that drafting costs.
    """

    __slots__ = (
        "cost", "max_k", "window", "probe_every", "probe_cap", "probe_k", "prior_mean",
        "prior_strength", "margin", "histogram", "_rounds", "_tried", "_accepted", "_speculating",
        "_idle", "_probe_interval", "_probing", "_alphas",
    )  # fmt: skip

    def __init__(
        self,
        cost: StepCost,
        max_k: int = DEFAULT_MAX_K,
        window: int = 16,
        probe_every: int = 16,
        probe_cap: int = 128,
        probe_k: int = 1,
        prior_mean: float = 0.7,
        prior_strength: float = 2.0,
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        for name, value in (("max_k", max_k), ("window", window), ("probe_every", probe_every),
                            ("probe_k", probe_k)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if probe_cap < probe_every:
            raise ValueError(f"probe_cap must be >= probe_every ({probe_every}), got {probe_cap}")
        if not 0.0 < prior_mean < 1.0:
            raise ValueError(f"prior_mean must be in (0, 1), got {prior_mean}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.cost, self.max_k, self.window = cost, max_k, window
        self.probe_every, self.probe_cap, self.probe_k = probe_every, probe_cap, probe_k
        self.prior_mean, self.prior_strength, self.margin = prior_mean, prior_strength, margin
        self.histogram: Counter[int] = Counter()
        self._rounds: deque[tuple[int, int]] = deque()  # (proposed, accepted), oldest first
        self._tried = [0] * (max_k + 1)  # [max_k + 1] by draft position, index 0 unused
        self._accepted = [0] * (max_k + 1)  # [max_k + 1]
        self._speculating = True
        self._idle = 0  # rounds at k = 0 since speculation stopped or the last probe
        self._probe_interval = probe_every
        self._probing = False
        self._alphas: dict[float, list[float]] = {}  # optimism → acceptance(), until a count moves

    def acceptance(self, optimism: float = 0.0) -> list[float]:
        """[max_k] estimated α_i = P(draft i accepted | drafts < i accepted), i = 1..max_k,
        each raised by `optimism` posterior standard deviations (capped at 1). Kept until
        the counts move: the planner asks every round, for every sequence not drafting."""
        cached = self._alphas.get(optimism)
        if cached is not None:
            return list(cached)
        strength = self.prior_strength
        pooled = (sum(self._accepted) + strength * self.prior_mean) / (sum(self._tried) + strength)
        alphas = []
        for tried, accepted in zip(self._tried[1:], self._accepted[1:]):
            mean = (accepted + strength * pooled) / (tried + strength)
            spread = math.sqrt(mean * (1.0 - mean) / (tried + strength + 1.0))
            alphas.append(min(1.0, max(0.0, mean + optimism * spread)))
        self._alphas[optimism] = alphas
        return list(alphas)

    def best_k(self, limit: int, optimism: float = 0.0) -> int:
        """argmax over k in 0..min(limit, max_k) of E(k) / T(k); ties go to the smaller k, and
        drafting must beat plain decoding by `margin` (a break-even estimate built on noisy
        timings is a likely loss: the goal is never to be slower than plain decoding)."""
        alphas = self.acceptance(optimism)
        best, best_rate = 0, (1.0 + self.margin) / max(self.cost.step_time(0), 1e-12)
        expected, reach = 1.0, 1.0  # E(k); P(all of the first k drafts accepted)
        top = min(limit, self.max_k)
        monotone = getattr(self.cost, "seeded", False)  # step times never fall with k
        for k in range(1, top + 1):
            reach *= alphas[k - 1]
            expected += reach
            seconds = max(self.cost.step_time(k), 1e-12)
            if expected / seconds > best_rate:
                best, best_rate = k, expected / seconds
            elif monotone and (expected + reach * (top - k)) / seconds <= best_rate:
                break  # a longer draft adds at most `reach` per token and costs no less
        return best

    def worth_starting(self, tokens_left: int, startup_s: float) -> bool:
        """Whether starting the drafter (`startup_s` seconds of draft prefill) pays over the
        `tokens_left` tokens still to generate: the seconds the best k saves per token, by a
        pessimistic acceptance estimate (one posterior standard deviation below the current
        one: the prior before any round), times `tokens_left`, must beat the start-up by
        `margin` (see the module doc). The start-up is spent for sure and the saving is a
        guess, so the guess is taken low."""
        k = self.best_k(tokens_left, optimism=-1.0)
        if k == 0:
            return False
        alphas, expected, reach = self.acceptance(-1.0), 1.0, 1.0
        for alpha in alphas[:k]:
            reach *= alpha
            expected += reach
        saved = self.cost.step_time(0) - self.cost.step_time(k) / expected  # per token
        return tokens_left * saved > (1.0 + self.margin) * startup_s

    @property
    def probing(self) -> bool:
        """The last `choose_k` was a probe (taken whatever the estimate says)."""
        return self._probing

    def choose_k(self, max_k: int) -> int:
        if max_k <= 0:
            return self._record(0)
        best = self.best_k(max_k)
        if best == 0 and self._speculating:
            best = self.best_k(max_k, optimism=1.0)
        self._speculating = best > 0
        if best > 0:
            self._idle = 0
            return self._record(best)
        self._idle += 1
        if self._idle < self._probe_interval:
            return self._record(0)
        self._probing = True
        return self._record(min(self.probe_k, max_k))

    def _record(self, k: int) -> int:
        self.histogram[k] += 1
        return k

    def observe(self, proposed: int, accepted: int) -> None:
        probing, self._probing = self._probing, False
        if proposed <= 0:
            return  # nothing was drafted (a due probe stays due)
        assert 0 <= accepted <= proposed, (proposed, accepted)
        success = probing and accepted == proposed
        if success:  # the text may have changed: the older half of the evidence goes
            keep = len(self._rounds) // 2
            while len(self._rounds) > keep:
                self._count(*self._rounds.popleft(), sign=-1)
        self._push(min(proposed, self.max_k), min(accepted, self.max_k))
        if probing:
            self._idle = 0
            self._probe_interval = (self.probe_every if success
                                    else min(2 * self._probe_interval, self.probe_cap))

    def _push(self, proposed: int, accepted: int) -> None:
        if len(self._rounds) == self.window:
            self._count(*self._rounds.popleft(), sign=-1)
        self._rounds.append((proposed, accepted))
        self._count(proposed, accepted, sign=1)

    def _count(self, proposed: int, accepted: int, sign: int) -> None:
        self._alphas.clear()
        for i in range(1, min(accepted + 1, proposed) + 1):
            self._tried[i] += sign
        for i in range(1, accepted + 1):
            self._accepted[i] += sign


