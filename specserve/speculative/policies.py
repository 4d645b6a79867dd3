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
- `cost_aware` (ours): maximise expected tokens per second,
      E(k) / T(k),   E(k) = 1 + Σ_{i=1..k} Π_{j≤i} α_j,   T(k) = draft(k) + verify(k),
  over k = 0..max_k, with α_j = P(draft j accepted | drafts < j accepted) estimated from
  the request's recent rounds and the times from the engine's shared `CostModel`. E(0) = 1
  and T(0) = verify(0) is plain decoding, so on hostile text the policy stops drafting;
  while it is off it probes with k = 1 every N rounds (N doubling after each failed probe,
  up to a cap) to notice when the text turns predictable again.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

POLICY_NAMES = ("fixed", "acceptance_rate", "accepted_length", "heuristic", "cost_aware")
DEFAULT_MIN_K = 1
DEFAULT_MAX_K = 8  # the bound of the adaptive policies (SPEC §5)
DEFAULT_DRAFT_STEP_RATIO = 0.1  # a draft step / a decode step, before either is measured
DEFAULT_VERIFY_ROW_RATIO = 0.1  # one more verified row / a decode step, before it is measured


class DraftPolicy(Protocol):
    histogram: Counter[int]

    def choose_k(self, max_k: int) -> int:
        """k for the next round, 0 ≤ k ≤ max_k."""

    def observe(self, proposed: int, accepted: int) -> None:
        """The outcome of the round just verified (`proposed` may be 0)."""


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


class CostModel:
    """Online estimates of a round's draft and verify times; one per engine, shared by its
    requests (timings are a property of the models and the device, not of the text).

    Each observation updates an EMA kept per draft-step count / per k; a k not measured in
    the last `max_age` observations is forgotten, so a slow first call (warm-up) or a drift
    cannot keep a k from ever being chosen again. A k without a measurement is read off a
    line fitted through the measured points (least squares, intercept and slope kept ≥ 0):
    draft time = a + b·steps, verify time = a + b·(k + 1) rows. With one verify point the
    line assumes each extra row costs `DEFAULT_VERIFY_ROW_RATIO` of a decode step; with one
    draft point, a cost proportional to the steps. Before anything is measured, a decode
    step is the unit and a draft step costs `DEFAULT_DRAFT_STEP_RATIO` of it.

    Once `seed`ed from a calibration, the calibration fixes the *shape*: how the cost grows
    with k (on the native kernels it rises in steps of four rows, which no line captures),
    and observations only move two scales, one for drafting and one for the rest of the
    round (EMA of observed / calibrated). A shared machine that slows down for a minute
    then slows every k alike, and the choice between them, which depends on their ratios,
    does not wander with the noise of whichever k happened to be measured in a slow second.
    """

    __slots__ = ("_draft", "_verify", "_lines", "_ema", "_base", "_scales")

    def __init__(self, ema: float = 0.2, max_age: int = 256) -> None:
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if max_age < 1:
            raise ValueError(f"max_age must be >= 1, got {max_age}")
        self._draft = _Timings(ema, max_age)  # draft steps → seconds of drafting them
        self._verify = _Timings(ema, max_age)  # k → seconds of a target pass over k + 1 rows
        self._lines: tuple[_Line, _Line] | None = None  # (draft, verify) fits; None = stale
        self._ema = ema
        self._base: CostModel | None = None  # the calibration (shape), once seeded
        self._scales = [1.0, 1.0]  # observed / calibrated: [drafting, the rest of a round]

    def seed(self, draft_step_s: float, verify_times: dict[int, float]) -> None:
        """Start from a calibration: one draft step's time and verify times by k. From then
        on the calibration is the shape and observations scale it (see the class doc)."""
        base = CostModel()
        base._draft.reset({1: _check_seconds("draft_step_s", draft_step_s)})
        base._verify.reset(
            {_check_k(k): _check_seconds("verify_times", s) for k, s in verify_times.items()}
        )
        self._base, self._scales = base, [1.0, 1.0]

    def snapshot(self) -> dict:
        """What the model currently believes, for reports: seconds of drafting k tokens and
        of the rest of a round with k drafts, for the ks measured or calibrated, and the
        observed / calibrated scales once seeded."""
        verify = self._base._verify.values if self._base is not None else self._verify.values
        ks = sorted({0, *verify})
        return {"seeded": self._base is not None,
                "scales": list(self._scales) if self._base is not None else None,
                "draft_s": {k: self.draft_time(k) for k in ks if k > 0},
                "verify_s": {k: self.verify_time(k) for k in ks}}

    def observe_draft(self, num_steps: int, seconds: float) -> None:
        """One round's drafting took `seconds` for `num_steps` draft steps (0: no drafting)."""
        if num_steps > 0:
            seconds = _check_seconds("seconds", seconds)
            if self._base is not None:
                self._rescale(0, seconds, self._base.draft_time(num_steps))
            else:
                self._draft.update(num_steps, seconds)
                self._lines = None

    def observe_verify(self, k: int, seconds: float) -> None:
        """A target pass over k + 1 rows took `seconds` (k = 0: a plain decode step)."""
        seconds, k = _check_seconds("seconds", seconds), _check_k(k)
        if self._base is not None:
            self._rescale(1, seconds, self._base.verify_time(k))
        else:
            self._verify.update(k, seconds)
            self._lines = None

    def _rescale(self, which: int, seconds: float, calibrated: float) -> None:
        """Seeded: only the scale moves (the per-k timings are not read once seeded)."""
        if calibrated > 0:
            self._scales[which] += self._ema * (seconds / calibrated - self._scales[which])

    def draft_time(self, k: int) -> float:
        if k <= 0:
            return 0.0
        if self._base is not None:
            return self._base.draft_time(k) * self._scales[0]
        measured = self._draft.values.get(k)
        return measured if measured is not None else self._fits()[0].at(k)

    def verify_time(self, k: int) -> float:
        if self._base is not None:
            return self._base.verify_time(k) * self._scales[1]
        measured = self._verify.values.get(k)
        return measured if measured is not None else self._fits()[1].at(k + 1)

    def round_time(self, k: int) -> float:
        """Estimated seconds of a round drafting k tokens; k = 0 is a plain decode step."""
        return self.draft_time(k) + self.verify_time(k)

    def _fits(self) -> tuple[_Line, _Line]:
        if self._lines is None:
            draft = self._draft.values
            per_step = sum(draft.values()) / sum(draft) if draft else None
            verify = self._verify_line(per_step)
            self._lines = (self._draft_line(per_step, verify.at(1)), verify)
        return self._lines

    def _draft_line(self, per_step: float | None, decode: float) -> _Line:
        if len(self._draft.values) >= 2:
            return _fit_line(self._draft.values)
        return _Line(0.0, per_step if per_step is not None else DEFAULT_DRAFT_STEP_RATIO * decode)

    def _verify_line(self, per_step: float | None) -> _Line:
        verify = self._verify.values
        if len(verify) >= 2:
            return _fit_line({k + 1: s for k, s in verify.items()})
        if verify:
            ((k, seconds),) = verify.items()
            decode = seconds / (1.0 + DEFAULT_VERIFY_ROW_RATIO * k)
        else:
            decode = per_step / DEFAULT_DRAFT_STEP_RATIO if per_step is not None else 1.0
        row = DEFAULT_VERIFY_ROW_RATIO * decode
        return _Line(decode - row, row)


class _Timings:
    """EMA seconds by x (draft steps, or k); an x not updated in `max_age` updates is dropped."""

    __slots__ = ("ema", "max_age", "values", "_stamps", "_clock")

    def __init__(self, ema: float, max_age: int) -> None:
        self.ema, self.max_age = ema, max_age
        self.values: dict[int, float] = {}
        self._stamps: dict[int, int] = {}  # x → the update count when x was last measured
        self._clock = 0

    def reset(self, values: dict[int, float]) -> None:
        self.values = dict(values)
        self._stamps = dict.fromkeys(values, self._clock)

    def update(self, x: int, seconds: float) -> None:
        self._clock += 1
        old = self.values.get(x)
        self.values[x] = seconds if old is None else self.ema * seconds + (1.0 - self.ema) * old
        self._stamps[x] = self._clock
        for stale in [y for y, stamp in self._stamps.items() if self._clock - stamp > self.max_age]:
            del self.values[stale], self._stamps[stale]


@dataclass(frozen=True, slots=True)
class _Line:
    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def _fit_line(points: dict[int, float]) -> _Line:
    """Least-squares y = a + b·x over ≥ 2 distinct x, with b ≥ 0 and then a ≥ 0 enforced."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    if slope < 0:
        return _Line(mean_y, 0.0)
    if mean_y - slope * mean_x < 0:  # refit through the origin
        return _Line(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return _Line(mean_y - slope * mean_x, slope)


def _check_seconds(name: str, seconds: float) -> float:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be finite seconds >= 0, got {seconds}")
    return float(seconds)


def _check_k(k: int) -> int:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return int(k)


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
        "_idle", "_probe_interval", "_probing",
    )  # fmt: skip

    def __init__(
        self,
        cost: CostModel,
        max_k: int = DEFAULT_MAX_K,
        window: int = 16,
        probe_every: int = 16,
        probe_cap: int = 128,
        probe_k: int = 1,
        prior_mean: float = 0.7,
        prior_strength: float = 2.0,
        margin: float = 0.08,
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

    def acceptance(self, optimism: float = 0.0) -> list[float]:
        """[max_k] estimated α_i = P(draft i accepted | drafts < i accepted), i = 1..max_k,
        each raised by `optimism` posterior standard deviations (capped at 1)."""
        strength = self.prior_strength
        pooled = (sum(self._accepted) + strength * self.prior_mean) / (sum(self._tried) + strength)
        alphas = []
        for tried, accepted in zip(self._tried[1:], self._accepted[1:]):
            mean = (accepted + strength * pooled) / (tried + strength)
            spread = math.sqrt(mean * (1.0 - mean) / (tried + strength + 1.0))
            alphas.append(min(1.0, mean + optimism * spread))
        return alphas

    def best_k(self, limit: int, optimism: float = 0.0) -> int:
        """argmax over k in 0..min(limit, max_k) of E(k) / T(k); ties go to the smaller k, and
        drafting must beat plain decoding by `margin` (a break-even estimate built on noisy
        timings is a likely loss: the goal is never to be slower than plain decoding)."""
        alphas = self.acceptance(optimism)
        best, best_rate = 0, (1.0 + self.margin) / max(self.cost.round_time(0), 1e-12)
        expected, reach = 1.0, 1.0  # E(k); P(all of the first k drafts accepted)
        for k in range(1, min(limit, self.max_k) + 1):
            reach *= alphas[k - 1]
            expected += reach
            rate = expected / max(self.cost.round_time(k), 1e-12)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def choose_k(self, max_k: int) -> int:
        if max_k <= 0:
            return _record(self.histogram, 0)
        best = self.best_k(max_k)
        if best == 0 and self._speculating:
            best = self.best_k(max_k, optimism=1.0)
        self._speculating = best > 0
        if best > 0:
            self._idle = 0
            return _record(self.histogram, best)
        self._idle += 1
        if self._idle < self._probe_interval:
            return _record(self.histogram, 0)
        self._probing = True
        return _record(self.histogram, min(self.probe_k, max_k))

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
        for i in range(1, min(accepted + 1, proposed) + 1):
            self._tried[i] += sign
        for i in range(1, accepted + 1):
            self._accepted[i] += sign


def make_policy(
    name: str, num_speculative_tokens: int, cost: CostModel | None, max_k: int = DEFAULT_MAX_K
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
