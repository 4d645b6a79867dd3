"""The timed passes' harness: calls during which the timing thread did not run are timed again."""

from __future__ import annotations

from specserve.speculative import calibration
from specserve.speculative.calibration import median_round_robin, settled_medians


class Clock:
    """A wall clock and a thread clock that timers advance: `ran` of each call's seconds ran."""

    def __init__(self) -> None:
        self.wall = self.thread = 0.0

    def timer(self, plan):
        """A timer whose n-th call takes plan[n] = (seconds, share of them this thread ran)."""
        calls = iter(plan)

        def time_one() -> float:
            seconds, ran = next(calls)
            self.wall += seconds
            self.thread += seconds * ran
            return seconds

        return time_one


def use(clock: Clock, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "perf_counter", lambda: clock.wall)
    monkeypatch.setattr(calibration, "thread_time", lambda: clock.thread)


def test_a_disturbed_call_is_timed_again_while_patience_lasts(monkeypatch):
    clock = Clock()
    use(clock, monkeypatch)
    quiet, busy = (1.0, 0.99), (3.0, 0.5)
    timers = {0: clock.timer([busy, quiet, busy, quiet, quiet]), 1: clock.timer([quiet] * 3)}
    medians, disturbed = settled_medians(timers, 3, patience_s=60.0)
    assert medians == {0: 1.0, 1: 1.0} and not disturbed  # the busy calls are not counted


def test_without_patience_a_busy_machine_keeps_every_call_and_says_so(monkeypatch):
    clock = Clock()
    use(clock, monkeypatch)
    busy, quiet = (3.0, 0.5), (1.0, 0.99)
    timers = {0: clock.timer([busy, busy, quiet]), 1: clock.timer([quiet] * 3)}
    medians, disturbed = settled_medians(timers, 3, patience_s=0.0)
    # every call counts when some timer lacks its settled calls: never mixed
    assert medians == {0: 3.0, 1: 1.0} and disturbed
    # the plain harness (the bench's) is the same without the flag
    timers = {0: clock.timer([busy, busy, quiet]), 1: clock.timer([quiet] * 3)}
    assert median_round_robin(timers, 3) == {0: 3.0, 1: 1.0}
    # a quiet machine needs no second round
    timers = {0: clock.timer([quiet] * 3)}
    assert settled_medians(timers, 3, patience_s=60.0) == ({0: 1.0}, False)


def test_an_interruption_stops_the_passes_between_two_calls(monkeypatch):
    clock = Clock()
    use(clock, monkeypatch)
    calls = []

    def timer() -> float:
        calls.append(1)
        return 1.0

    asked = iter([False, False, True])
    medians, disturbed = settled_medians({0: timer, 1: timer}, 3, 60.0, lambda: next(asked))
    assert (medians, disturbed) == ({}, True) and len(calls) == 2
