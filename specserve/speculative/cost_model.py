"""The engine's cost model: how long a step takes, by draft steps and by target rows.

One per engine, seeded by timed passes at start-up (`calibration.py`) and following every
round. `pass_time(R)`: a target pass over R rows (`verify_time(R - 1)`); `step_time(k)`: a
batched step of B sequences each verifying k + 1 rows, `draft_time(k) + pass_time(B·(k +
1))` (B set by `set_step`); `draft_prefill_time(n)`: starting a draft model on n positions.
Why: docs/design.md, "The cost model".
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

DEFAULT_DRAFT_STEP_RATIO = 0.1  # a draft step / a decode step, before either is measured
DEFAULT_VERIFY_ROW_RATIO = 0.1  # one more verified row / a decode step, before it is measured
DEFAULT_DRAFT_PREFILL_RATIO = 0.15  # a draft prefill position / a draft step, when not measured
SHAPE_EMA = 0.05  # the residual of a pass size moves this far towards each of its observations
SHAPE_DECAY = 1.0 / 512  # per observation, the weight of what every size was seen with fades
MIN_SHAPE_OBSERVATIONS = 8  # passes of a size before its shape correction is used
SHAPE_BOUNDS = (0.4, 2.5)  # the correction of a calibrated pass time stays within these
SHAPE_REFRESH = 8  # observations between recomputations of the corrections (host time)


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
    and observations move two scales, one for drafting and one for the rest of the
    round (EMA of observed / calibrated; drafting's is relative to the rest's, so it moves
    with the machine even while nothing drafts). A shared machine that slows down for a
    minute then slows every k alike, and the choice between them, which depends on their ratios,
    does not wander with the noise of whichever k happened to be measured in a slow second.

    The calibration times one sequence after a short prefix, a few times each, at start-up;
    the passes that serve are batches of sequences with longer contexts. So the shape is
    corrected where the passes show it wrong, slowly and only relative to other row counts:
    per pass size, a slow EMA of observed / (calibrated × scale) (its *residual*), and the
    correction of a size is its residual over the mean residual of the recently observed
    sizes (weighted by how often each was seen, decaying). Passes of one size alone correct
    nothing (a slowdown is the scale's), but a fifth row that costs more than the calibration
    said, among passes of four, is priced at what it costs (`MIN_SHAPE_OBSERVATIONS` passes
    of that size first; corrections bounded by `SHAPE_BOUNDS`). A size's first
    observations are averaged (its EMA starts as a running mean), so a few passes suffice.

    Corrected pass times are kept non-decreasing in rows: a pass over more rows never costs
    less, though per-size corrections learned from different batches could say so (and the
    controller's budget stops its search at the first pass too slow for its cap).

    A calibration taken while other work shared the cores can over-price every row beyond
    the first, and then no draft is verified, no larger pass is seen, and nothing corrects
    it: the controller's probes (`budget.PROBE_EVERY`) time a pass one row larger now
    and then, and a size never observed takes the correction of the nearest observed size
    below it when that one proved cheaper than calibrated (never dearer: a size priced too
    high is never run and never corrected, one priced too low is run, seen and corrected).
    The converse, a plain pass over-priced while the engine drafts every step and so never
    times it, makes drafts look cheap: the controller's downward probes time it (`seen`).
    """

    __slots__ = ("_draft", "_verify", "_lines", "_ema", "_base", "_scales", "_prefill",
                 "_shape", "_curve", "_steps", "batch_size")

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
        # observed / calibrated: [drafting relative to the rest, the rest of a round]
        self._scales = [1.0, 1.0]
        self._prefill: float | None = None  # calibrated seconds per draft prefill position
        self._shape = _ShapeCorrection()  # seeded: per pass size, calibrated → observed
        # seeded: [k] → the corrected calibration, never falling with k (see `verify_time`),
        # before the scale; rebuilt when the corrections change
        self._curve: list[float] = []
        self._steps: dict[tuple[int, int], float] = {}  # (B, k) → step_time until an observation
        self.batch_size = 1  # decoding sequences in the step being planned (see `set_step`)

    def seed(self, draft_step_s: float, verify_times: dict[int, float],
             draft_prefill_s: float | None = None) -> None:
        """Start from a calibration: one draft step's time, verify times by k and (if
        measured) seconds per draft prefill position. From then on the calibration is the
        shape and observations scale it (see the class doc). A pass over more rows never
        costs less, so verify times that noise left decreasing in k are pooled to their mean
        (`non_decreasing`): otherwise the budget would take the k that happened to be timed
        fast, and never see what it really costs."""
        base = CostModel()
        base._draft.reset({1: _check_seconds("draft_step_s", draft_step_s)})
        base._verify.reset(non_decreasing(
            {_check_k(k): _check_seconds("verify_times", s) for k, s in verify_times.items()}))
        if draft_prefill_s is not None:
            base._prefill = _check_seconds("draft_prefill_s", draft_prefill_s)
        self._base, self._scales, self._shape = base, [1.0, 1.0], _ShapeCorrection()
        self._curve, self._steps = [], {}

    @property
    def seeded(self) -> bool:
        """Whether a calibration fixes the shape: then pass and step times never fall as
        rows or drafts grow (unseeded measured points may, by noise)."""
        return self._base is not None

    def snapshot(self) -> dict:
        """What the model currently believes, for reports: seconds of drafting k tokens and
        of the rest of a round with k drafts, for the ks measured or calibrated, and the
        observed / calibrated scales once seeded."""
        verify = self._base._verify.values if self._base is not None else self._verify.values
        ks = sorted({0, *verify})
        return {"seeded": self.seeded,
                "scales": [self._draft_scale(), self._scales[1]] if self._base is not None
                else None,
                "draft_s": {k: self.draft_time(k) for k in ks if k > 0},
                "verify_s": {k: self.verify_time(k) for k in ks}}

    def observe_draft(self, num_steps: int, seconds: float) -> None:
        """One round's drafting took `seconds` for `num_steps` draft steps (0: no drafting)."""
        if num_steps > 0:
            seconds = _check_seconds("seconds", seconds)
            self._steps.clear()
            if self._base is not None:
                self._rescale(0, seconds, self._base.draft_time(num_steps) * self._scales[1])
            else:
                self._draft.update(num_steps, seconds)
                self._lines = None

    def observe_verify(self, k: int, seconds: float) -> None:
        """A target pass over k + 1 rows took `seconds` (k = 0: a plain decode step)."""
        seconds, k = _check_seconds("seconds", seconds), _check_k(k)
        self._steps.clear()
        if self._base is not None:
            calibrated = self._base.verify_time(k)
            self._rescale(1, seconds, calibrated * self._shape.factor(k))
            if self._shape.observe(k, seconds / max(calibrated * self._scales[1], 1e-12)):
                self._curve = []
        else:
            self._verify.update(k, seconds)
            self._lines = None

    def _draft_scale(self) -> float:
        """Observed / calibrated drafting: the machine's scale (learned from every round)
        times drafting's own, learned only from rounds that draft; so a draft not run for a
        while (or not yet started) is still priced on a machine that slowed down."""
        return self._scales[0] * self._scales[1]

    def _rescale(self, which: int, seconds: float, calibrated: float) -> None:
        """Seeded: only the scale moves (the per-k timings are not read once seeded)."""
        if calibrated > 0:
            self._scales[which] += self._ema * (seconds / calibrated - self._scales[which])

    def draft_time(self, k: int) -> float:
        if k <= 0:
            return 0.0
        if self._base is not None:
            return self._base.draft_time(k) * self._draft_scale()
        measured = self._draft.values.get(k)
        return measured if measured is not None else self._fits()[0].at(k)

    def verify_time(self, k: int) -> float:
        if self._base is not None:
            curve = self._curve
            for j in range(len(curve), k + 1):  # never below a smaller pass's
                curve.append(max(curve[-1] if curve else 0.0,
                                 self._base.verify_time(j) * self._shape.factor(j)))
            return curve[k] * self._scales[1]
        measured = self._verify.values.get(k)
        return measured if measured is not None else self._fits()[1].at(k + 1)

    def draft_prefill_time(self, num_tokens: int) -> float:
        """Estimated seconds of a draft prefill of `num_tokens` positions (see the module doc)."""
        if num_tokens <= 0:
            return 0.0
        base = self._base if self._base is not None else self
        per_token = base._prefill if base._prefill is not None \
            else DEFAULT_DRAFT_PREFILL_RATIO * base.draft_time(1)
        scale = self._draft_scale() if self._base is not None else 1.0
        return num_tokens * per_token * scale

    def round_time(self, k: int) -> float:
        """Estimated seconds of a round drafting k tokens; k = 0 is a plain decode step."""
        return self.draft_time(k) + self.verify_time(k)

    def pass_time(self, rows: int) -> float:
        """Estimated seconds of a target pass over `rows` rows (any mix of sequences)."""
        return self.verify_time(max(rows, 1) - 1)

    def seen(self, rows: int) -> float:
        """How often a pass over `rows` rows was timed lately (its fading weight in the shape
        correction; 0 before a calibration): the controller's downward probes time a size
        the serving passes have stopped showing."""
        return self._shape.weight.get(max(rows, 1) - 1, 0.0) if self._base is not None else 0.0

    def set_step(self, batch_size: int) -> None:
        """The step being planned decodes `batch_size` sequences."""
        self.batch_size = max(batch_size, 1)

    def step_time(self, k: int) -> float:
        """Estimated seconds of the step if each of its sequences drafts k (see the module doc).
        Kept until the next observation: every sequence's policy asks, every step."""
        key = (self.batch_size, k)
        seconds = self._steps.get(key)
        if seconds is None:
            seconds = self._steps[key] = self.draft_time(k) + self.pass_time(
                self.batch_size * (k + 1))
        return seconds

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


class _ShapeCorrection:
    """Seeded pass times' correction per size k (see the `CostModel` doc): `residual[k]`, a
    slow EMA of observed / (calibrated × scale); `weight[k]`, its observations, fading."""

    __slots__ = ("residual", "weight", "count", "_factors", "_below", "_pending")

    def __init__(self) -> None:
        self.residual: dict[int, float] = {}
        self.weight: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._factors: dict[int, float] = {}
        self._below: list[int] = []  # the corrected sizes, ascending
        self._pending = 0  # observations since the corrections were recomputed

    def observe(self, k: int, ratio: float) -> bool:
        """One pass of size k took `ratio` times its calibrated, scaled time. Returns whether
        the corrections changed: they are recomputed every `SHAPE_REFRESH` observations and
        when a size has just been seen often enough to be corrected (every step observes one
        pass, and the residuals move by `SHAPE_EMA` at most, so a few steps' lag is nothing;
        recomputing costs every planner's price curve)."""
        count = self.count[k] = self.count.get(k, 0) + 1
        old = self.residual.get(k, 1.0)
        self.residual[k] = old + max(SHAPE_EMA, 1.0 / count) * (ratio - old)
        for size in self.weight:
            self.weight[size] *= 1.0 - SHAPE_DECAY
        self.weight[k] = self.weight.get(k, 0.0) + 1.0
        self._pending += 1
        if self._pending < SHAPE_REFRESH and count != MIN_SHAPE_OBSERVATIONS:
            return False
        self._pending = 0
        total = sum(self.weight.values())
        mean = sum(self.weight[s] * self.residual[s] for s in self.weight) / total
        lo, hi = SHAPE_BOUNDS
        self._factors = {s: min(hi, max(lo, r / mean)) for s, r in self.residual.items()
                         if self.count[s] >= MIN_SHAPE_OBSERVATIONS}
        self._below = sorted(self._factors)
        return True

    def factor(self, k: int) -> float:
        """A corrected size's factor; an uncorrected one's: the nearest corrected size
        below it, if that one is cheaper than calibrated (see the `CostModel` doc), else 1."""
        factor = self._factors.get(k)
        if factor is not None:
            return factor
        below = bisect.bisect_left(self._below, k)
        return min(1.0, self._factors[self._below[below - 1]]) if below else 1.0


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


def non_decreasing(points: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of `points` (x → y) in x order: runs of points
    that decrease are replaced by their mean (pool adjacent violators)."""
    blocks: list[list] = []  # [sum of y, count] per pooled run, in x order
    for x in sorted(points):
        blocks.append([points[x], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(count)]
    return dict(zip(sorted(points), fitted))


def _check_seconds(name: str, seconds: float) -> float:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be finite seconds >= 0, got {seconds}")
    return float(seconds)


def _check_k(k: int) -> int:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return int(k)


