"""The step's budget of draft rows: which offered slots one step verifies, and the probes.

Every decoding sequence's offer (`Offer`: the survival of each draft it could verify) is a
list of slots; one step takes the prefix of all slots by survival with the most expected
tokens per second, priced by the cost model, where what it adds beats the rate without it by
the margin and no sequence's expected rate falls below 1/(1 + `SLOWDOWN_CAP`) of plain
decoding's. Probes keep the prices true: one more row now and then where the budget left a
lookup slot out, one row fewer (or the plain pass) where a smaller pass was not timed lately.
Why: docs/design.md ("The speculation controller").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specserve.speculative.cost_aware import DEFAULT_MARGIN

LOOKUP, MODEL = "lookup", "draft_model"  # the two kinds of source (free, in the step)
SLOWDOWN_CAP = 0.25  # a step's drafts leave no sequence's expected rate below 1/1.25 of plain
PROBE_EVERY = 64  # steps whose budget left a lookup slot out, per probe of one more row
PROBE_DOWN_EVERY = 16  # steps whose budget took a slot, per probe of one row fewer ...
SEEN_LATELY = 4.0  # ... of a pass size the cost model has seen less than this lately


@dataclass(slots=True)
class Offer:
    """What one sequence could verify this step: `survival` [k] P(first i drafts accepted)."""

    source: str | None = None
    survival: list[float] = field(default_factory=list)
    forced: bool = False  # taken whole (a fixed k, a probe), outside the budget
    reason: str = "no_match"  # why nothing is offered


def best_prefix(survival: list[float], source: str, cost) -> tuple[int, float]:
    """(j, rate): the prefix length of `survival` (an offer of `source`) with the most
    expected tokens per second at the cost model's batch size, and that rate (0 when there
    is nothing)."""
    best, best_rate, expected = 0, 0.0, 1.0
    for j, s in enumerate(survival, 1):
        expected += s
        seconds = cost.step_time(j) if source == MODEL else \
            cost.pass_time(cost.batch_size * (j + 1))
        rate = expected / max(seconds, 1e-12)
        if rate > best_rate:
            best, best_rate = j, rate
    return best, best_rate


class StepBudget:
    """The budget's choice per step (`choose`), and the probes' counters."""

    def __init__(self) -> None:
        self.probe_every = PROBE_EVERY  # (see docs/design.md, probes)
        self.probe_down_every = PROBE_DOWN_EVERY
        self._left_out = 0  # steps since the last probe whose budget left a lookup slot out
        self._took = 0  # steps since the last downward probe whose budget took a slot
        self.probes = 0  # probes taken
        self.probes_down = 0  # ... and downward probes
        self.plain_probe = False  # the last step's choice is a plain probe

    def choose(self, offers: list[Offer], batch: int, cost, max_rows: int | None = None
               ) -> list[int]:
        """Per offer, how many of its slots the step verifies (see docs/design.md, step 2):
        the prefix of the slots by survival with the most expected tokens per second, kept
        only if what it adds (tokens over seconds) beats the rate without it by the margin;
        and no more than `max_rows` slots of the budget's."""
        forced = [len(o.survival) if o.forced else 0 for o in offers]  # taken whatever it costs
        counts = list(forced)
        gains = [1.0 + (sum(o.survival) if o.forced else 0.0) for o in offers]  # E per sequence
        value = sum(gains)
        slots = sorted((-s, pos, i) for i, o in enumerate(offers) if not o.forced
                       for pos, s in enumerate(o.survival))
        if max_rows is not None:
            slots = slots[:max_rows]
        base_value, base_time = value, self._step_seconds(offers, counts, batch, cost)
        chosen, best_rate = list(counts), base_value / base_time
        # the most any sequence's expected tokens can reach: once a prefix of the slots is
        # slower than the cap allows for it, every longer prefix is too where a pass over
        # more rows never costs less (a calibrated cost model), so the search stops there
        fair_bound = (1.0 + SLOWDOWN_CAP) * base_time * min(
            (g + sum(o.survival) * (not o.forced) for g, o in zip(gains, offers)), default=1.0
        ) if cost.seeded else math.inf
        for neg_s, pos, i in slots:
            assert counts[i] == pos, "slots of one sequence are taken in order"
            counts[i] += 1
            value -= neg_s
            gains[i] -= neg_s
            seconds = self._step_seconds(offers, counts, batch, cost)
            if seconds > fair_bound:
                break
            rate = value / seconds
            added = (value - base_value) / max(seconds - base_time, 1e-12)
            fair = seconds <= (1.0 + SLOWDOWN_CAP) * base_time * min(gains, default=1.0)
            if (rate > best_rate and fair
                    and added > (1.0 + DEFAULT_MARGIN) * base_value / base_time):
                best_rate, chosen = rate, list(counts)
        self.plain_probe = False
        return self._probe(offers, forced, chosen, slots, batch, cost)

    def _probe(self, offers: list[Offer], forced: list[int], chosen: list[int], slots: list,
               batch: int, cost) -> list[int]:
        """`chosen`, plus one more lookup slot once every `probe_every` steps that left one
        out: the likeliest slot next in line for its sequence; or, once every
        `probe_down_every` steps that took one, less: in a batch whose plain pass was not
        timed lately, every slot not `forced` (the plain pass); else the least likely slot
        taken, where a pass that much smaller was not timed lately (see docs/design.md,
        step 3)."""
        left_out = [(neg_s, i) for neg_s, pos, i in slots
                    if pos == chosen[i] and offers[i].source == LOOKUP]
        if left_out or any(o.reason == "backed_off" for o in offers):  # (left out unlooked)
            self._left_out += 1
            if left_out and self._left_out >= self.probe_every:
                self._left_out = 0
                self.probes += 1
                chosen = list(chosen)
                chosen[min(left_out)[1]] += 1
                return chosen
        taken = [(neg_s, i) for neg_s, pos, i in slots if pos == chosen[i] - 1]
        if taken:
            self._took += 1
            if self._took >= self.probe_down_every:
                if batch > 1 and cost.seen(batch + sum(forced)) < SEEN_LATELY:
                    # the pass every choice is priced against: in a batch, rows cost what
                    # their contexts make them cost, and drafting steps show larger passes
                    self._took = 0
                    self.probes_down += 1
                    self.plain_probe = True
                    return list(forced)
                if cost.seen(batch + sum(chosen) - 1) < SEEN_LATELY:
                    self._took = 0
                    self.probes_down += 1
                    chosen = list(chosen)
                    chosen[max(taken)[1]] -= 1
        return chosen

    @staticmethod
    def _step_seconds(offers: list[Offer], counts: list[int], batch: int, cost) -> float:
        steps = max((c for o, c in zip(offers, counts) if o.source == MODEL), default=0)
        seconds = cost.draft_time(steps) + cost.pass_time(batch + sum(counts))
        return max(seconds, 1e-12)
