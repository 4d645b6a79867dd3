"""The cost-aware policy prices the whole batched step: drafting survives a large batch while the
target pass is memory-bound and stops once verify rows cost as much as decode rows."""

from __future__ import annotations

from specserve.engine.cost_model import CostModel
from specserve.speculative.cost_aware import CostAwarePolicy

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
