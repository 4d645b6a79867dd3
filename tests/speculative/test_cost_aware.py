"""The cost-aware policy prices the whole batched step: drafting survives a large batch while the
target pass is memory-bound and stops once verify rows cost as much as decode rows."""

from __future__ import annotations

from specserve.speculative.cost_model import CostModel
from specserve.speculative.cost_aware import CostAwarePolicy
from tests.speculative.unpruned import Unpruned

DECODE = 0.05  # seconds of a one-row pass


def seeded(pass_seconds) -> CostModel:
    """A cost model calibrated with `pass_seconds(rows)` for 1..129 rows, draft step 0.1·DECODE."""
    cost = CostModel()
    cost.seed(0.1 * DECODE, {rows - 1: pass_seconds(rows) for rows in range(1, 130)})
    return cost


def confident(cost: CostModel) -> CostAwarePolicy:
    """A policy that has seen drafts accepted 80% of the time at every position."""
    policy = CostAwarePolicy(cost, max_k=4)
    for accepted in [4, 3, 4, 2, 4, 4, 3, 4] * 2:
        policy.observe(4, accepted)
    return policy


def test_memory_bound_pass_keeps_drafting_at_batch_16():
    cost = seeded(lambda rows: DECODE * (1 + 0.002 * rows))  # weights read once per pass
    policy = confident(cost)
    for batch in (1, 16):
        cost.set_step(batch)
        assert policy.best_k(4) >= 3, batch


def test_compute_bound_pass_stops_drafting_at_batch_16_but_not_alone():
    cost = seeded(lambda rows: DECODE * (0.5 + 0.5 * rows))  # every row costs half a decode
    policy = confident(cost)
    cost.set_step(1)
    assert policy.best_k(4) > 0
    cost.set_step(16)
    assert policy.best_k(4) == 0
    # the step time is that of 16 sequences each verifying k + 1 rows
    assert cost.step_time(2) == cost.draft_time(2) + cost.pass_time(48)


def test_starting_the_drafter_pays_for_a_long_request_but_not_a_short_one():
    """Start-up rule: the best k's saving per token at the prior acceptance, times the tokens
    still to generate, must beat the draft prefill's seconds."""
    cost = seeded(lambda rows: DECODE * (1 + 0.01 * rows))
    cost.set_step(1)
    policy = CostAwarePolicy(cost, max_k=4)  # no rounds yet: the prior (0.7) decides
    k = policy.best_k(255)
    assert k > 0
    expected = 1 + sum(0.7 ** i for i in range(1, k + 1))
    saved = cost.step_time(0) - cost.step_time(k) / expected  # seconds per token
    startup = 100 * saved  # a start that the saving over 100 tokens pays for, and no more
    assert policy.worth_starting(255, startup)
    assert not policy.worth_starting(15, startup)
    assert not policy.worth_starting(100, startup)  # break-even is not enough (the margin)
    assert policy.worth_starting(100, 0.0)
    assert sum(policy.histogram.values()) == 0  # asking is not a round


def test_starting_the_drafter_never_pays_where_the_batch_makes_drafting_lose():
    cost = seeded(lambda rows: DECODE * (0.5 + 0.5 * rows))  # compute-bound passes
    policy = confident(cost)
    cost.set_step(1)
    assert policy.worth_starting(1000, 0.01)
    cost.set_step(16)
    assert not policy.worth_starting(1000, 0.0)


def test_starting_the_drafter_follows_what_the_request_has_learned():
    cost = seeded(lambda rows: DECODE * (1 + 0.01 * rows))
    cost.set_step(1)
    hostile = CostAwarePolicy(cost, max_k=4)
    for _ in range(8):
        hostile.observe(2, 0)
    assert not hostile.worth_starting(1000, 0.0)
    assert confident(cost).worth_starting(1000, 0.5)


class Counting(Unpruned):
    """The same cost model, shortcut allowed, counting the step times asked for."""

    seeded = True

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self.calls = 0

    def step_time(self, k: int) -> float:
        self.calls += 1
        return self._model.step_time(k)


def test_the_searchs_early_stop_picks_what_trying_every_k_picks():
    import random

    rng = random.Random(0)
    stopped_early = 0
    for trial in range(200):
        slope = rng.uniform(0.0, 1.2)
        cost = seeded(lambda rows, s=slope: DECODE * (1 + s * (rows - 1) ** rng.uniform(0.5, 1.5)))
        for _ in range(rng.randint(0, 30)):  # served passes: shape corrections, scales
            cost.observe_verify(rng.randint(0, 20), DECODE * rng.uniform(0.5, 3.0))
        max_k = rng.randint(1, 16)
        policy = CostAwarePolicy(cost, max_k=max_k)
        for _ in range(rng.randint(0, 20)):
            k = rng.randint(1, max_k)
            policy.observe(k, min(k, int(rng.expovariate(1 / rng.uniform(0.2, 6)))))
        full = CostAwarePolicy(Unpruned(cost), max_k=max_k)
        full._tried, full._accepted = policy._tried, policy._accepted
        cost.set_step(rng.randint(1, 8))
        for optimism in (-1.0, 0.0, 1.0):
            limit = rng.randint(1, 20)
            assert policy.best_k(limit, optimism) == full.best_k(limit, optimism), trial
        counting = CostAwarePolicy(Counting(cost), max_k=max_k)
        counting._tried, counting._accepted = policy._tried, policy._accepted
        counting.best_k(16)
        stopped_early += counting.cost.calls < min(16, max_k) + 1
    assert stopped_early > 20  # the shortcut is taken, not only harmless


def test_a_pass_over_more_rows_is_never_priced_below_a_smaller_one():
    cost = seeded(lambda rows: DECODE * (1 + 0.1 * (rows - 1)))
    for _ in range(40):  # 9-row passes served at a third of their calibrated price
        cost.observe_verify(0, DECODE)
        cost.observe_verify(8, DECODE * 1.8 / 3)
    times = [cost.pass_time(rows) for rows in range(1, 20)]
    assert times == sorted(times)
    assert cost.pass_time(9) == cost.pass_time(8)  # the cheap size takes its smaller one's price
