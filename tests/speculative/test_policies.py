"""Tests for the draft-length policies: the simple rules step by step on hand-made traces,
the cost model's estimates, and the cost-aware policy on seeded synthetic traces of
acceptance and timing (hostile, friendly, and one that changes mid-way)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specserve.speculative.cost_model import (DEFAULT_DRAFT_PREFILL_RATIO, MIN_SHAPE_OBSERVATIONS,
                                             CostModel, non_decreasing)
from specserve.speculative.cost_aware import CostAwarePolicy
from specserve.speculative.policies import (
    AcceptanceRatePolicy,
    AcceptedLengthPolicy,
    FixedPolicy,
    HeuristicPolicy,
    make_policy,
)

DECODE = 0.02  # seconds of a plain decode step in the synthetic timings


def seeded_cost(draft_ratio: float, row_ratio: float = 0.05) -> CostModel:
    """Draft step = draft_ratio × decode; verify(k) = decode · (1 + row_ratio·k)."""
    cost = CostModel()
    cost.seed(draft_ratio * DECODE, {k: DECODE * (1 + row_ratio * k) for k in range(9)})
    return cost


def leading_successes(rng: np.random.Generator, alpha: float, k: int) -> int:
    """Accepted drafts of a round: each accepted with probability alpha, up to the first miss."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


def simulate(policy, alphas, seed: int = 0, limit: int = 8):
    """Run one round per entry of `alphas`; returns the chosen ks and accepted counts."""
    rng = np.random.default_rng(seed)
    ks, accepted = [], []
    for alpha in alphas:
        k = policy.choose_k(limit)
        got = leading_successes(rng, alpha, k)
        policy.observe(k, got)
        ks.append(k)
        accepted.append(got)
    return ks, accepted


def expected_rate(alpha: float, k: int, cost: CostModel) -> float:
    """Tokens per second of fixed k under i.i.d. acceptance alpha."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) / cost.round_time(k)


def run_trace(policy, trace: list[tuple[int, int]], limit: int = 8) -> list[int]:
    ks = []
    for proposed, accepted in trace:
        ks.append(policy.choose_k(limit))
        policy.observe(proposed, accepted)
    return ks


# ---------------------------------------------------------------- simple policies


def test_fixed_policy_always_chooses_k_clipped_by_the_engine_room():
    policy = FixedPolicy(5)
    assert [policy.choose_k(limit) for limit in (8, 8, 3, 0)] == [5, 5, 3, 0]
    policy.observe(5, 0)
    assert policy.choose_k(8) == 5
    assert policy.histogram == {5: 3, 3: 1, 0: 1}


def test_acceptance_rate_steps_by_one_at_the_thresholds():
    policy = AcceptanceRatePolicy(start_k=4)
    trace = [(4, 4), (5, 4), (6, 3), (6, 2), (5, 0), (4, 0), (0, 0), (3, 3)]
    # rates: 1.0 → +1, 0.8 (= high) → +1, 0.5 → stay, 0.33 → −1, 0 → −1, 0 → −1, nothing, 1 → +1
    assert run_trace(policy, trace) == [4, 5, 6, 6, 5, 4, 3, 3]
    assert policy.choose_k(8) == 4
    assert policy.histogram == {4: 3, 5: 2, 6: 2, 3: 2}


def test_acceptance_rate_stays_within_its_bounds():
    policy = AcceptanceRatePolicy(start_k=7)
    assert run_trace(policy, [(7, 7), (8, 8), (8, 8)]) == [7, 8, 8]
    assert policy.choose_k(8) == 8
    low = AcceptanceRatePolicy(start_k=2)
    assert run_trace(low, [(2, 0), (1, 0), (1, 0)]) == [2, 1, 1]
    assert low.choose_k(8) == 1
    assert low.choose_k(0) == 0  # the engine's room still wins


def test_accepted_length_follows_the_ema_and_rounds_half_up():
    policy = AcceptedLengthPolicy(start_k=4)  # s = 3
    trace = [(4, 4), (4, 0), (4, 0), (3, 3), (0, 0)]
    # s: 3 → 3.2 → 2.56 → 2.048 → 2.2384 → unchanged; k = round(s) + 1
    assert run_trace(policy, trace) == [4, 4, 4, 3, 3]
    assert policy.smoothed == pytest.approx(2.2384)
    assert policy.choose_k(8) == 3
    half = AcceptedLengthPolicy(start_k=3, ema=0.5)  # s = 2
    half.observe(3, 1)  # s = 1.5 rounds up to 2
    assert half.choose_k(8) == 3


def test_accepted_length_stays_within_its_bounds():
    policy = AcceptedLengthPolicy(start_k=1)
    run_trace(policy, [(1, 0)] * 5)
    assert policy.choose_k(8) == 1
    run_trace(policy, [(8, 8)] * 20)  # s ≈ 7.9: round(s) + 1 = 9 is clipped
    assert policy.choose_k(8) == 8
    assert policy.choose_k(5) == 5


def test_heuristic_adds_two_after_full_acceptance_and_drops_one_otherwise():
    policy = HeuristicPolicy(start_k=4)
    trace = [(4, 4), (6, 6), (8, 8), (8, 7), (7, 0), (0, 0), (6, 6)]
    assert run_trace(policy, trace) == [4, 6, 8, 8, 7, 6, 6]
    assert policy.choose_k(8) == 8
    low = HeuristicPolicy(start_k=1)
    run_trace(low, [(1, 0), (1, 0)])
    assert low.choose_k(8) == 1
    assert low.histogram == {1: 3}


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: FixedPolicy(-1), "num_speculative_tokens"),
        (lambda: AcceptanceRatePolicy(0), "start_k"),
        (lambda: AcceptanceRatePolicy(4, low=0.9, high=0.5), "low"),
        (lambda: AcceptedLengthPolicy(4, ema=0.0), "ema"),
        (lambda: HeuristicPolicy(9), "start_k"),
        (lambda: HeuristicPolicy(3, min_k=4, max_k=2), "max_k"),
        (lambda: CostAwarePolicy(CostModel(), window=0), "window"),
        (lambda: CostAwarePolicy(CostModel(), probe_every=8, probe_cap=4), "probe_cap"),
        (lambda: CostAwarePolicy(CostModel(), prior_mean=1.0), "prior_mean"),
        (lambda: CostModel(ema=1.5), "ema"),
        (lambda: CostModel(max_age=0), "max_age"),
    ],
)
def test_bad_policy_settings_raise_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


# ---------------------------------------------------------------- cost model


def test_cost_model_returns_seeded_times_and_extrapolates_linearly():
    cost = CostModel()
    cost.seed(0.003, {0: 0.010, 4: 0.014})
    assert cost.draft_time(0) == 0.0
    assert cost.draft_time(1) == pytest.approx(0.003)
    assert cost.draft_time(5) == pytest.approx(0.015)  # one step measured: proportional
    assert cost.verify_time(4) == pytest.approx(0.014)
    assert cost.verify_time(2) == pytest.approx(0.012)  # on the line through k = 0 and 4
    assert cost.verify_time(8) == pytest.approx(0.018)
    assert cost.round_time(2) == pytest.approx(0.006 + 0.012)


def test_cost_model_keeps_an_ema_per_k():
    cost = CostModel(ema=0.25)
    cost.observe_verify(0, 0.010)
    cost.observe_verify(0, 0.030)
    assert cost.verify_time(0) == pytest.approx(0.25 * 0.030 + 0.75 * 0.010)
    cost.observe_draft(2, 0.004)
    cost.observe_draft(0, 5.0)  # no draft work: ignored
    assert cost.draft_time(2) == pytest.approx(0.004)
    assert cost.draft_time(4) == pytest.approx(0.008)


def test_cost_model_fits_draft_overhead_plus_per_step_cost():
    cost = CostModel()
    for steps in (1, 2, 4):
        cost.observe_draft(steps, 0.001 + 0.002 * steps)
    assert cost.draft_time(8) == pytest.approx(0.017)
    assert cost.draft_time(3) == pytest.approx(0.007)


def test_cost_model_forgets_a_k_not_measured_for_max_age_observations():
    cost = CostModel(max_age=10)
    cost.observe_verify(8, 1.0)  # a slow warm-up call
    for _ in range(10):
        cost.observe_verify(0, 0.010)
        cost.observe_verify(4, 0.014)
    assert cost.verify_time(8) == pytest.approx(0.018)  # back on the line of fresh points
    assert cost.verify_time(4) == pytest.approx(0.014)


def test_cost_model_defaults_are_relative_to_what_was_measured():
    blank = CostModel()
    assert blank.verify_time(0) == pytest.approx(1.0)
    assert blank.draft_time(1) == pytest.approx(0.1)
    one_point = CostModel()
    one_point.observe_verify(0, 0.02)
    assert one_point.verify_time(0) == pytest.approx(0.02)
    assert one_point.verify_time(5) == pytest.approx(0.02 * 1.5)  # 10% of a decode per row
    assert one_point.draft_time(2) == pytest.approx(0.004)  # 10% of a decode per step
    drafts_only = CostModel()
    drafts_only.observe_draft(1, 0.003)
    assert drafts_only.verify_time(0) == pytest.approx(0.03)


def test_cost_model_fit_never_predicts_negative_or_decreasing_times():
    cost = CostModel()
    cost.observe_verify(0, 0.020)
    cost.observe_verify(4, 0.010)  # noise: slower decode than verify
    assert cost.verify_time(8) == pytest.approx(0.015)  # flat at the mean
    with pytest.raises(ValueError, match="seconds"):
        cost.observe_verify(1, -0.1)
    with pytest.raises(ValueError, match="seconds"):
        cost.observe_draft(1, math.nan)
    with pytest.raises(ValueError, match="k must"):
        cost.observe_verify(-1, 0.1)


# ---------------------------------------------------------------- cost-aware policy


def test_cost_aware_stops_drafting_on_hostile_text_with_an_expensive_draft():
    cost = seeded_cost(draft_ratio=0.4)
    policy = CostAwarePolicy(cost)
    ks, accepted = simulate(policy, [0.1] * 300, seed=1)
    assert ks[0] > 0  # a new request starts optimistic
    assert 0 in ks[:10]  # ... and gives up after a few bad rounds
    assert policy.histogram[0] >= 270  # only the occasional probe after that
    seconds = sum(cost.round_time(k) for k in ks)
    tokens = sum(a + 1 for a in accepted)
    assert tokens / seconds >= 0.95 / cost.verify_time(0)  # ≈ never slower than target-only


def test_cost_aware_drafts_the_most_on_friendly_text_with_a_cheap_draft():
    policy = CostAwarePolicy(seeded_cost(draft_ratio=0.05))
    ks, _ = simulate(policy, [0.95] * 200, seed=2)
    assert 0 < ks[0] < 8  # optimistic but cautious before any evidence
    assert ks[-100:].count(8) >= 95
    assert policy.histogram[8] >= 190


@pytest.mark.parametrize(("draft_ratio", "alpha"), [(0.1, 0.7), (0.4, 0.7), (0.05, 0.5)])
def test_cost_aware_chooses_close_to_the_best_fixed_k(draft_ratio, alpha):
    cost = seeded_cost(draft_ratio)
    policy = CostAwarePolicy(cost)
    simulate(policy, [alpha] * 400, seed=3)
    best = max(expected_rate(alpha, k, cost) for k in range(9))
    chosen = sum(expected_rate(alpha, k, cost) * n for k, n in policy.histogram.items()) / 400
    assert chosen >= 0.93 * best


def test_cost_aware_resumes_when_hostile_text_turns_friendly():
    policy = CostAwarePolicy(seeded_cost(draft_ratio=0.4), probe_every=8, probe_cap=64)
    ks, _ = simulate(policy, [0.1] * 300 + [0.95] * 300, seed=4)
    assert sum(k > 0 for k in ks[100:300]) <= 12  # probes back off to one per 64 rounds
    friendly = ks[300:]
    resumed = next(i for i in range(len(friendly)) if all(k > 0 for k in friendly[i : i + 10]))
    assert resumed <= 3 * 64  # one of the next probes is fully accepted
    assert np.mean(friendly[resumed + 20 :]) >= 4


def idle_rounds_before_probe(policy: CostAwarePolicy) -> int:
    """Rounds at k = 0 until the policy probes (the probe's round not counted)."""
    idle = 0
    while policy.choose_k(8) == 0:
        policy.observe(0, 0)
        idle += 1
        assert idle < 1000, "never probed"
    return idle


def test_cost_aware_probe_interval_doubles_after_failures_and_resets_after_success():
    policy = CostAwarePolicy(seeded_cost(draft_ratio=0.4), probe_every=8, probe_cap=64)
    for _ in range(16):
        policy.observe(2, 0)
    gaps = []
    for _ in range(6):
        gaps.append(idle_rounds_before_probe(policy) + 1)
        policy.observe(2, 0)  # the probe fails
    assert gaps == [8, 16, 32, 64, 64, 64]
    idle_rounds_before_probe(policy)
    policy.observe(2, 2)  # a fully accepted probe: the interval resets ...
    assert policy.choose_k(8) == 0  # ... but one lucky probe does not restart drafting
    policy.observe(0, 0)
    assert 1 + idle_rounds_before_probe(policy) + 1 == 8
    successes = 1
    while True:  # each further success halves the old evidence, until drafting pays again
        policy.observe(2, 2)
        successes += 1
        k = policy.choose_k(8)
        if k > 0:
            break
        policy.observe(0, 0)
        assert 1 + idle_rounds_before_probe(policy) + 1 == 8
    assert 2 <= successes <= 4
    while k > 0:  # ... until bad rounds stop it again
        policy.observe(k, 0)
        k = policy.choose_k(8)


def test_cost_aware_probe_waits_for_a_round_that_actually_drafts():
    policy = CostAwarePolicy(seeded_cost(draft_ratio=0.4), probe_every=4, probe_cap=4, probe_k=2)
    for _ in range(8):
        policy.observe(1, 0)
    for _ in range(3):
        assert policy.choose_k(8) == 0
        policy.observe(0, 0)
    assert policy.choose_k(8) == 2  # the 4th idle round probes...
    policy.observe(0, 0)  # ... but the drafter found nothing,
    assert policy.choose_k(8) == 2  # so the probe is retried
    assert policy.choose_k(0) == 0  # no room: no probe


def test_cost_aware_estimates_acceptance_per_position():
    policy = CostAwarePolicy(seeded_cost(0.1), window=16)
    for _ in range(16):
        policy.observe(4, 1)  # position 1 always accepted, position 2 always rejected
    alphas = policy.acceptance()
    assert alphas[0] > 0.85 and alphas[1] < 0.2
    assert policy.acceptance(optimism=1.0)[1] > alphas[1]
    assert policy.best_k(8) == 1


def test_cost_aware_window_forgets_old_rounds():
    policy = CostAwarePolicy(seeded_cost(0.1), window=4)
    for _ in range(10):
        policy.observe(3, 0)
    for _ in range(4):
        policy.observe(3, 3)  # the zeros have left the window
    assert min(policy.acceptance()[:3]) > 0.9


def test_cost_aware_respects_the_engine_room_and_counts_choices():
    policy = CostAwarePolicy(seeded_cost(draft_ratio=0.05))
    simulate(policy, [0.95] * 20, seed=5, limit=3)
    assert set(policy.histogram) <= {1, 2, 3}
    assert sum(policy.histogram.values()) == 20
    assert policy.histogram[3] >= 18


# ---------------------------------------------------------------- factory


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("fixed", FixedPolicy),
        ("acceptance_rate", AcceptanceRatePolicy),
        ("accepted_length", AcceptedLengthPolicy),
        ("heuristic", HeuristicPolicy),
        ("cost_aware", CostAwarePolicy),
    ],
)
def test_make_policy_builds_each_named_policy(name, kind):
    policy = make_policy(name, 4, CostModel())
    assert isinstance(policy, kind)
    assert 0 < policy.choose_k(8) <= 4


def test_make_policy_handles_adaptive_disabled_and_large_k():
    cost = CostModel()
    adaptive = make_policy("fixed", -1, cost)
    assert isinstance(adaptive, CostAwarePolicy) and adaptive.max_k == 8
    assert make_policy("heuristic", -1, cost, max_k=12).max_k == 12
    assert make_policy("cost_aware", 3, cost).max_k == 3
    assert make_policy("heuristic", 0, cost).choose_k(8) == 0
    wide = make_policy("heuristic", 10, None)
    assert wide.choose_k(16) == 10


def test_make_policy_rejects_bad_names_and_values():
    with pytest.raises(ValueError, match="draft_policy"):
        make_policy("greedy", 4, CostModel())
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_policy("fixed", -2, CostModel())
    with pytest.raises(ValueError, match="CostModel"):
        make_policy("cost_aware", 4, None)


def test_cost_aware_does_not_draft_for_a_gain_inside_its_margin():
    """At break-even (drafting predicted 3% faster than plain decoding) the policy stays at
    k = 0: noisy timings make such a gain a likely loss. With margin 0 it drafts."""
    cost = seeded_cost(draft_ratio=0.4, row_ratio=0.0)
    # α such that k = 1 gives (1 + α) / 1.4 = 1.03 decode steps' worth of tokens per step
    alpha = 1.03 * 1.4 - 1.0
    cautious, eager = CostAwarePolicy(cost), CostAwarePolicy(cost, margin=0.0)
    for policy in (cautious, eager):
        for _ in range(16):
            policy.observe(1, 1)
            policy.observe(1, 0)
        policy._tried[1], policy._accepted[1] = 1000, round(1000 * alpha)
    assert cautious.best_k(1) == 0
    assert eager.best_k(1) == 1
    with pytest.raises(ValueError, match="margin"):
        CostAwarePolicy(cost, margin=-0.1)


def test_seeded_cost_model_keeps_the_calibrated_shape_and_scales_it():
    """After a calibration, observations scale every k alike: a machine that slows down
    keeps the ratios between k (the step at four rows included), so the choice holds."""
    cost = CostModel(ema=0.5)
    shape = {0: 0.100, 1: 0.115, 2: 0.130, 3: 0.140, 4: 0.180, 7: 0.270}
    cost.seed(0.050, shape)
    assert cost.verify_time(3) == pytest.approx(0.140)
    assert cost.verify_time(5) == pytest.approx(cost.verify_time(4) + (cost.verify_time(7) - cost.verify_time(4)) / 3, rel=0.2)
    for _ in range(30):  # everything now runs twice as slowly, observed at k = 3 only
        cost.observe_verify(3, 0.280)
        cost.observe_draft(3, 0.300)
    for k, seconds in shape.items():
        assert cost.verify_time(k) == pytest.approx(2 * seconds, rel=1e-3)
    assert cost.draft_time(5) == pytest.approx(2 * 5 * 0.050, rel=1e-3)
    ratios = [cost.round_time(k) / cost.round_time(0) for k in range(5)]
    calm = CostModel()
    calm.seed(0.050, shape)
    assert ratios == pytest.approx([calm.round_time(k) / calm.round_time(0) for k in range(5)], rel=1e-3)
    snap = cost.snapshot()
    assert snap["seeded"] and snap["scales"] == pytest.approx([2.0, 2.0], rel=1e-3)
    assert snap["verify_s"] == pytest.approx({k: 2 * s for k, s in shape.items()}, rel=1e-3)
    assert snap["draft_s"][7] == pytest.approx(2 * 7 * 0.050, rel=1e-3)


def test_non_cost_aware_policies_start_the_drafter_whenever_they_draft():
    assert FixedPolicy(3).worth_starting(1, 1e9)
    assert not FixedPolicy(0).worth_starting(1 << 20, 0.0)  # speculation off: never started
    for policy in (AcceptanceRatePolicy(2), AcceptedLengthPolicy(2), HeuristicPolicy(2)):
        assert policy.worth_starting(1, 1e9)


def test_draft_prefill_time_is_calibrated_per_position_and_follows_the_draft_scale():
    cost = CostModel(ema=1.0)
    assert cost.draft_prefill_time(0) == 0.0
    cost.seed(0.02, {0: 0.1, 1: 0.11}, draft_prefill_s=0.001)
    assert cost.draft_prefill_time(200) == pytest.approx(0.2)
    cost.observe_draft(1, 0.04)  # drafting runs twice as slow as calibrated
    assert cost.draft_prefill_time(200) == pytest.approx(0.4)
    uncalibrated = CostModel()
    uncalibrated.seed(0.02, {0: 0.1})
    assert uncalibrated.draft_prefill_time(10) == pytest.approx(10 * 0.02 * DEFAULT_DRAFT_PREFILL_RATIO)


def test_a_machine_slowdown_seen_only_in_plain_rounds_also_prices_the_draft_higher():
    """While nothing drafts (a draft not started yet), plain rounds alone tell the cost model
    the machine slowed down: drafting and a draft start are priced up alike, so the ratio
    that decides whether to start does not drift with the machine's load."""
    cost = CostModel(ema=1.0)
    cost.seed(0.02, {0: 0.1, 1: 0.11}, draft_prefill_s=0.001)
    cost.observe_verify(0, 0.3)  # three times slower, seen at k = 0 only
    assert cost.verify_time(1) == pytest.approx(0.33)
    assert cost.draft_time(2) == pytest.approx(3 * 0.04)
    assert cost.draft_prefill_time(100) == pytest.approx(3 * 0.1)
    cost.observe_draft(1, 0.03)  # then drafting turns out only half as slow as the rest
    assert cost.draft_time(1) == pytest.approx(0.03)
    assert cost.verify_time(0) == pytest.approx(0.3)


def test_calibrated_times_that_noise_left_decreasing_are_pooled():
    """A pass over more rows never costs less: an inversion in the calibration (5 rows timed
    faster than 4) is pooled to its mean, so the budget cannot pick a k for having been
    timed in a quiet moment."""
    assert non_decreasing({0: 1.0, 1: 3.0, 2: 2.0, 3: 4.0}) == {0: 1.0, 1: 2.5, 2: 2.5, 3: 4.0}
    assert non_decreasing({0: 1.0, 4: 2.0, 7: 3.0}) == {0: 1.0, 4: 2.0, 7: 3.0}
    cost = CostModel()
    cost.seed(0.01, {0: 0.100, 1: 0.104, 2: 0.112, 3: 0.108, 4: 0.125})
    times = [cost.verify_time(k) for k in range(5)]
    assert times == sorted(times) and times[2] == pytest.approx(0.110) == times[3]


def test_a_pass_size_the_calibration_got_wrong_is_corrected_relative_to_the_others():
    """Passes of 4 rows cost what the calibration said, passes of 5 cost 20% more (a batch's
    fifth row, which the calibration's single sequence did not show): after enough of
    both, 5 rows are priced 20% above 4 rows' share; a size never observed takes the average
    correction of those seen (here half way), and a slowdown still scales every size."""
    shape = {3: 0.100, 4: 0.105, 5: 0.110, 8: 0.130}
    cost = CostModel()
    cost.seed(0.01, shape)
    for _ in range(200):
        cost.observe_verify(3, 0.100)
        cost.observe_verify(4, 0.126)
    assert cost.verify_time(4) / cost.verify_time(3) == pytest.approx(1.26, rel=0.03)
    assert cost.verify_time(8) / cost.verify_time(3) == pytest.approx(1.3 * 1.1, rel=0.03)
    for _ in range(30):  # then the machine slows to half speed: every size alike
        cost.observe_verify(3, 0.200)
        cost.observe_verify(4, 0.252)
    assert cost.verify_time(3) == pytest.approx(0.200, rel=0.05)
    assert cost.verify_time(4) == pytest.approx(0.252, rel=0.05)
    few = CostModel()  # too few passes of a size: no correction yet
    few.seed(0.01, shape)
    for _ in range(MIN_SHAPE_OBSERVATIONS - 1):
        few.observe_verify(4, 0.2)
    assert few.verify_time(4) / few.verify_time(3) == pytest.approx(1.05)


def test_a_size_never_seen_takes_a_cheaper_correction_from_below_never_a_dearer_one():
    """Passes of one row and of two: two rows cost half what the calibration said. Three
    rows, never seen, are priced with that correction too (a calibration that over-priced
    rows usually over-priced them all, and a price too low is soon seen and corrected, one
    too high never); but where the size below proved dearer, no correction is carried up."""
    shape = {0: 0.050, 1: 0.100, 2: 0.150}
    cheaper = CostModel()
    cheaper.seed(0.01, shape)
    for _ in range(MIN_SHAPE_OBSERVATIONS):  # averaged from the first: a few passes suffice
        cheaper.observe_verify(0, 0.050)
        cheaper.observe_verify(1, 0.050)
    ratio = cheaper.verify_time(1) / cheaper.verify_time(0)
    assert ratio == pytest.approx(1.0, rel=0.1)  # calibrated 2.0
    assert cheaper.verify_time(2) / cheaper.verify_time(0) == pytest.approx(3.0 * ratio / 2.0,
                                                                           rel=0.01)
    dearer = CostModel()
    dearer.seed(0.01, shape)
    for _ in range(4 * MIN_SHAPE_OBSERVATIONS):
        dearer.observe_verify(0, 0.050)
        dearer.observe_verify(1, 0.150)
    assert dearer.verify_time(1) / dearer.verify_time(0) == pytest.approx(3.0, rel=0.1)
    # three rows keep the average correction of the sizes seen (see the test above), not two
    # rows' dearer one: priced below 1.5x two rows, as calibrated
    assert dearer.verify_time(2) / dearer.verify_time(1) < 0.9 * shape[2] / shape[1]
