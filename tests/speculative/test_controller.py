"""The speculation controller's choices, on stubbed timings and acceptances (table tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specserve.engine.outputs import SpeculationOverride
from specserve.speculative.candidate import Candidate
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.budget import (LOOKUP, MODEL, PROBE_DOWN_EVERY, PROBE_EVERY,
                                         SEEN_LATELY, SLOWDOWN_CAP)
from specserve.speculative.controller import BACKOFF_AFTER, MAX_BACKOFF, SpeculationController
from specserve.speculative.cost_model import CostModel
from specserve.speculative.drafter import Drafter, Proposal
from specserve.speculative.metrics import SpecMetrics
from tests.speculative.unpruned import Unpruned

MEMORY_BOUND = {k: 0.050 + 0.001 * k for k in range(17)}  # extra rows nearly free
COMPUTE_BOUND = {k: 0.050 * (k + 1) for k in range(17)}  # every row a decode step's worth
MODERATE = {k: 0.050 * (1 + 0.1 * k) for k in range(17)}  # a row: 10% of a decode step


class Seq:
    def __init__(self, seq_id: int, left: int = 100) -> None:
        self.seq_id, self.token_ids, self.prompt_len, self.left = seq_id, [1, 2, 3], 3, left
        self.prompt_ids = self.token_ids[:3]
        self.metrics = SpecMetrics()
        self.spec = self.grammar = None  # the controller's state; no grammar


    def tokens_left(self) -> int:
        return self.left


class Lookup(Drafter):
    """A lookup source with a scripted candidate per sequence id."""

    name = "suffix"

    def __init__(self, candidates: dict[int, Candidate]) -> None:
        self.candidates = candidates

    def candidate(self, seq, limit: int, extra=()) -> Candidate:
        c = self.candidates.get(seq.seq_id, Candidate([], [], 0))
        return Candidate(c.tokens[:limit], c.confidence[:limit], c.match_len, c.from_cache)

    def finish(self, seq, keep: bool = True) -> None:
        pass


class Model(Drafter):
    """A draft model that is always ready and drafts token 7."""

    name, in_step = "draft_model", True

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def ready(self, seq) -> bool:
        return True

    def started(self, seq) -> bool:
        return True

    def pending(self) -> bool:
        return False

    def start(self, seq) -> None:
        pass

    def finish(self, seq, keep: bool = True) -> None:
        pass

    def commit(self, seq, num_accepted: int, old_len: int) -> None:
        pass

    def propose(self, seqs, ks):
        self.asked.append(list(ks))
        return [Proposal([7] * k, None) for k in ks]


@dataclass
class Plan:
    """What the scheduler hands the controller: the decoding sequences and their k."""

    decode: list
    ks: list
    chunks: list = field(default_factory=list)
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)


def propose(ctrl: SpeculationController, seqs: list, ks: list[int]) -> list[Proposal]:
    return ctrl.propose(Plan(seqs, ks))


def commit(ctrl: SpeculationController, seq, proposal: Proposal, accepted: int,
           old_len: int) -> None:
    """The verifier kept `accepted` of the proposal (a round whose cost is not learned)."""
    ctrl.observe(Plan([seq], [proposal.k]), [proposal], [accepted], [old_len])


def cost(verify: dict[int, float], draft_step: float = 0.01) -> CostModel:
    model = CostModel()
    model.seed(draft_step, verify, draft_prefill_s=0.001)
    return model


def long_match(n: int = 16) -> Candidate:
    return Candidate(list(range(10, 10 + n)), [1.0] * n, 20)  # a 20-token match: trusted


def weak_match(n: int = 4) -> Candidate:
    return Candidate(list(range(10, 10 + n)), [0.5] * n, 1)  # one token matched, votes split


def controller(verify, candidates, model=None, **config) -> SpeculationController:
    spec = SpeculativeConfig(method="hybrid" if model else "suffix",
                             model="draft" if model else None,
                             num_speculative_tokens=config.pop("k", -1), **config)
    return SpeculationController(spec, cost(verify), [Lookup(candidates)] + ([model] if model else []))


def plan(ctrl: SpeculationController, seqs: list[Seq], overrides=None) -> list[int]:
    for i, seq in enumerate(seqs):
        ctrl.join([seq], (overrides or {}).get(i))
    ks = ctrl.plan(seqs)
    return [ks[s.seq_id] for s in seqs]


@pytest.mark.parametrize(("verify", "candidate", "expected"), [
    (MEMORY_BOUND, long_match(), 16),  # cheap rows, a trusted match: draft it all
    (MEMORY_BOUND, weak_match(), 1),  # rows at 2%: a 7% chance pays for one row, not more
    (MODERATE, weak_match(), 0),  # rows at 10%: a hopeless draft is not worth them
    (COMPUTE_BOUND, weak_match(), 0),
    (COMPUTE_BOUND, Candidate([], [], 0), 0),  # nothing to draft
])
def test_one_sequence_drafts_what_pays(verify, candidate, expected):
    assert plan(controller(verify, {0: candidate}), [Seq(0)]) == [expected]


def test_costly_rows_shorten_a_good_draft():
    costly = {k: 0.050 * (1 + 0.3 * k) for k in range(17)}  # a row: 30% of a decode step
    ks = plan(controller(costly, {0: long_match()}), [Seq(0)])
    assert 0 < ks[0] < 16  # only the positions likeliest to survive are worth their row
    assert plan(controller(COMPUTE_BOUND, {0: long_match()}), [Seq(0)]) == [0]


def test_a_busy_step_spends_its_rows_on_the_drafts_most_likely_to_survive():
    # four sequences, each row at 30% of a decode step: the trusted match drafts, the weak
    # ones do not, although alone a weak one may still pay at memory-bound cost
    verify = {k: 0.050 + 0.015 * k for k in range(64)}
    ctrl = controller(verify, {0: weak_match(), 1: long_match(8), 2: weak_match(), 3: weak_match()})
    ks = plan(ctrl, [Seq(i) for i in range(4)])
    assert ks[1] > 0 and ks[0] == ks[2] == ks[3] == 0


def test_draft_lengths_are_bounded_by_the_tokens_left_and_the_bonus():
    assert plan(controller(MEMORY_BOUND, {0: long_match()}), [Seq(0, left=6)]) == [5]
    assert plan(controller(MEMORY_BOUND, {0: long_match()}), [Seq(0, left=1)]) == [0]


def test_a_fixed_k_is_taken_as_asked_and_the_budget_does_not_trim_it():
    ks = plan(controller(COMPUTE_BOUND, {0: weak_match()}, k=3), [Seq(0)])
    assert ks == [3]


def test_disable_by_batch_size_turns_drafting_off_for_the_whole_step():
    ctrl = controller(MEMORY_BOUND, {0: long_match(), 1: long_match()}, disable_by_batch_size=2)
    seqs = [Seq(0), Seq(1)]
    assert plan(ctrl, seqs) == [0, 0]
    assert ctrl.state(seqs[0]).reason == "batch_limit"


def test_a_request_can_turn_speculation_off_or_fix_its_k():
    ctrl = controller(MEMORY_BOUND, {0: long_match(), 1: long_match(), 2: long_match()})
    seqs = [Seq(0), Seq(1), Seq(2)]
    ks = plan(ctrl, seqs, {0: SpeculationOverride(enabled=False),
                           1: SpeculationOverride(num_speculative_tokens=2)})
    # the sequence that asked for none is slowed by the others' drafts by at most the cap
    assert ks[0] == 0 and ks[1] == 2 and 0 < ks[2] < 16
    cost = ctrl.cost
    assert cost.pass_time(3 + 2 + ks[2]) <= (1 + SLOWDOWN_CAP) * cost.pass_time(3 + 2)
    assert cost.pass_time(3 + 2 + ks[2] + 1) > (1 + SLOWDOWN_CAP) * cost.pass_time(3 + 2)
    assert ctrl.state(seqs[0]).reason == "off"


def test_the_drafts_of_some_slow_a_sequence_that_drafts_nothing_by_at_most_the_cap(monkeypatch):
    # rows at 10% of a decode step: a plain step of 4 rows costs 0.065 s; 3 more rows stretch
    # it to 0.08 s (1.23x), a fourth to 0.085 s (1.31x)
    ctrl = controller(MODERATE, {1: long_match()})
    assert plan(ctrl, [Seq(i) for i in range(4)]) == [0, 3, 0, 0]
    # when every sequence gains, each one's expected rate stays within the cap of plain
    # decoding's, so the drafts run long
    ctrl = controller(MODERATE, {i: long_match() for i in range(4)})
    ks = plan(ctrl, [Seq(i) for i in range(4)])
    assert min(ks) > 3
    # without the cap the same step drafts more of the trusted match (by tokens per second)
    import specserve.speculative.budget as module
    monkeypatch.setattr(module, "SLOWDOWN_CAP", 100.0)
    uncapped = plan(controller(MODERATE, {1: long_match()}), [Seq(i) for i in range(4)])
    assert uncapped[0] == uncapped[2] == uncapped[3] == 0 and uncapped[1] > 3
    # alone, the cap never binds: a draft that beats plain decoding's rate is within it
    alone = plan(controller(MODERATE, {0: long_match()}), [Seq(0)])
    monkeypatch.setattr(module, "SLOWDOWN_CAP", 0.0)
    assert plan(controller(MODERATE, {0: long_match()}), [Seq(0)]) == alone and alone[0] > 3


def test_the_draft_model_is_used_only_where_the_lookup_does_not_pay():
    model = Model()
    ctrl = controller(MEMORY_BOUND, {0: long_match()}, model=model)
    seqs = [Seq(0), Seq(1)]  # 0 has a trusted match, 1 has none
    for seq in seqs:
        ctrl.join([seq])
        ctrl.state(seq).policy.prior_mean = 0.9  # a draft model that agrees a lot
    ks = ctrl.plan(seqs)
    assert ks[0] > 0 and ks[1] > 0
    assert ctrl.state(seqs[0]).source == LOOKUP and ctrl.state(seqs[1]).source == MODEL
    proposals = propose(ctrl, seqs, [ks[0], ks[1]])
    assert proposals[0].tokens == list(range(10, 10 + ks[0]))  # the lookup's tokens
    assert proposals[1].tokens == [7] * ks[1]  # the model's
    assert model.asked == [[0, ks[1]]]  # the model ran for sequence 1 only


def test_a_sequence_that_drafts_nothing_never_runs_the_draft_model():
    model = Model()
    ctrl = controller(COMPUTE_BOUND, {}, model=model)
    seqs = [Seq(0)]
    ctrl.join([seqs[0]])
    ctrl.state(seqs[0]).policy.prior_mean = 0.2  # it would not pay
    ks = ctrl.plan(seqs)
    assert ks == {0: 0}
    assert propose(ctrl, seqs, [0])[0].k == 0 and model.asked == []


def test_lookup_acceptance_is_learned_per_match_length():
    ctrl = controller(MODERATE, {0: Candidate([5, 6, 7, 8], [1.0] * 4, 2)})
    seq = Seq(0)
    ctrl.join([seq])
    before = ctrl.stats.survival([1.0] * 4, 2, False)
    assert ctrl.plan([seq])[0] > 0  # the prior trusts a 2-token match enough at first
    for _ in range(20):  # every draft rejected at once
        ks = ctrl.plan([seq])
        proposal = propose(ctrl, [seq], [ks[0]])[0]
        if not proposal.k:
            break
        commit(ctrl, seq, proposal, 0, len(seq.token_ids))
    after = ctrl.stats.survival([1.0] * 4, 2, False)
    assert after[0] < before[0] and ctrl.plan([seq]) == {0: 0}
    assert seq.metrics.sources["suffix"][2] == 0  # recorded: drafted, none accepted
    assert ctrl.stats.survival([1.0] * 4, 20, False) == before_long(ctrl)


def before_long(ctrl: SpeculationController) -> list[float]:
    """Another match-length bucket is untouched by what the short matches taught."""
    from specserve.speculative.match_stats import MatchStats

    return MatchStats().survival([1.0] * 4, 20, False)


def test_sources_and_idle_reasons_are_reported_per_sequence():
    ctrl = controller(MEMORY_BOUND, {0: long_match()})
    seq, other = Seq(0), Seq(1)
    ks = plan(ctrl, [seq, other])
    proposals = propose(ctrl, [seq, other], [ks[0], ks[1]])
    commit(ctrl, seq, proposals[0], 3, len(seq.token_ids))
    commit(ctrl, other, proposals[1], 0, len(other.token_ids))
    assert ks[0] > 3
    assert seq.metrics.by_source == {"suffix": {"rounds": 1, "drafted": ks[0], "accepted": 3,
                                                "acceptance_rate": 3 / ks[0]}}
    assert other.metrics.idle == {"no_match": 1}
    assert MODEL not in seq.metrics.sources


def run_rounds(ctrl: SpeculationController, seqs: list[Seq], accepted, rounds: int) -> list[list[int]]:
    """`rounds` plan/propose/commit rounds; `accepted(seq, k)` is what the verifier keeps."""
    history = []
    for _ in range(rounds):
        ks = ctrl.plan(seqs)
        proposals = propose(ctrl, seqs, [ks[s.seq_id] for s in seqs])
        for seq, proposal in zip(seqs, proposals):
            commit(ctrl, seq, proposal, accepted(seq, proposal.k), len(seq.token_ids))
        history.append([ks[s.seq_id] for s in seqs])
    return history


def test_a_request_that_copies_less_than_the_table_expects_learns_it_from_its_own_rounds():
    """Two requests share the table; one's short matches are always rejected, the other's
    always kept. Each one's first position is priced by its own record, not by the table
    alone (which averages them): the first soon drafts one token at most, the second all."""
    match = Candidate([5, 6, 7, 8], [1.0] * 4, 2)
    ctrl = controller(MODERATE, {0: match, 1: match})
    seqs = [Seq(0), Seq(1)]
    for seq in seqs:
        ctrl.join([seq])
    history = run_rounds(ctrl, seqs, lambda seq, k: 0 if seq.seq_id == 0 else k, 12)
    poor, good = (ctrl.state(s).fit.factor() for s in seqs)
    assert poor < 0.7 and good > 1.3, (poor, good)
    table = ctrl.stats.survival([1.0] * 4, 2, False)
    assert ctrl.stats.survival([1.0] * 4, 2, False, ctrl.state(seqs[0]).fit)[0] < 0.7 * table[0]
    assert all(ks[0] <= 1 and ks[1] == 4 for ks in history[3:]), history
    shared = controller(MODERATE, {0: match, 1: match})  # the table alone, as before fits
    for seq in (s0 := Seq(0), s1 := Seq(1)):
        shared.join([seq])
    for seq in (s0, s1):
        shared.state(seq).fit.accepted = shared.state(seq).fit.expected = 1e9  # factor 1
    assert run_rounds(shared, [s0, s1], lambda seq, k: 0 if seq.seq_id == 0 else k, 12)[-1][0] > 1
    fresh = Seq(2)
    ctrl.join([fresh])  # a new request starts from the table's own rate
    assert ctrl.state(fresh).fit.factor() == 1.0


def test_a_batched_sequence_whose_lookups_never_pay_looks_less_often_until_one_does():
    """In a batch, a sequence that copies poorly (its fit below 1) and drafted nothing for
    a few looks skips rounds between looks (host time is a cost too); one drafting sequence
    beside it never does, and a look that drafts again ends the back-off."""
    weak = Candidate([5], [0.2], 1)  # a hopeless one-token draft, offered every round
    ctrl = controller(MODERATE, {0: weak, 1: long_match(4)})
    seqs = [Seq(0), Seq(1)]
    for seq in seqs:
        ctrl.join([seq])
    ctrl.state(seqs[0]).fit.expected = 5.0  # it has copied less than the table expected
    reasons = []
    for _ in range(24):
        run_rounds(ctrl, seqs, lambda seq, k: k, 1)
        reasons.append(ctrl.state(seqs[0]).reason)
    assert reasons[:BACKOFF_AFTER] == ["did_not_pay"] * BACKOFF_AFTER
    assert reasons.count("backed_off") >= 12 and "backed_off" in reasons[-4:]
    assert seqs[0].metrics.idle["backed_off"] == reasons.count("backed_off")
    # the drafting one never idles, but for a plain probe now and then (ctrl.budget.probes_down)
    assert ctrl.state(seqs[1]).idle == 0 and set(seqs[1].metrics.idle) <= {"probe"}
    ctrl.lookup.candidates[0] = long_match(4)  # its text starts repeating
    for _ in range(MAX_BACKOFF + 1):
        run_rounds(ctrl, seqs, lambda seq, k: k, 1)
    assert ctrl.state(seqs[0]).reason != "backed_off" and ctrl.state(seqs[0]).wait == 0
    alone = controller(MODERATE, {0: weak})  # one sequence: every round is looked at
    seq = Seq(0)
    alone.join([seq])
    alone.state(seq).fit.expected = 5.0
    run_rounds(alone, [seq], lambda s, k: k, 16)
    assert "backed_off" not in seq.metrics.idle


def test_in_a_batch_offers_that_never_pay_back_off_unless_the_sequence_proved_it_copies():
    """Eight sequences on a compute-bound machine: one weak row per sequence never pays, so
    their offers are never taken. A sequence with no record yet (fit exactly 1) stops
    looking every round after BACKOFF_AFTER such looks (it looked every round at eight
    sequences, ~1% of each step in host time); one whose record shows it copies better
    than the table (fit above 1) keeps looking."""
    batch = 8
    ctrl = controller(COMPUTE_BOUND, {i: weak_match(1) for i in range(batch)})
    seqs = [Seq(i) for i in range(batch)]
    for seq in seqs:
        ctrl.join([seq])
    ctrl.state(seqs[0]).fit.accepted = 4.0  # it has copied more than the table expected
    assert ctrl.state(seqs[0]).fit.factor() > 1.0 == ctrl.state(seqs[1]).fit.factor()
    reasons = [[] for _ in seqs]
    for _ in range(32):
        run_rounds(ctrl, seqs, lambda seq, k: k, 1)
        for i, seq in enumerate(seqs):
            reasons[i].append(ctrl.state(seq).reason)
    assert "backed_off" not in reasons[0] and reasons[0].count("did_not_pay") == 32
    for rs in reasons[1:]:
        assert rs[:BACKOFF_AFTER] == ["did_not_pay"] * BACKOFF_AFTER
        assert rs.count("backed_off") >= 16


def test_while_prompts_wait_to_prefill_the_drafts_take_at_most_the_rows_allowed():
    """Verify rows share a step's token budget with prefill chunks: with a bound, the step
    drafts no more rows than that, and they are the likeliest to survive."""
    ctrl = controller(MEMORY_BOUND, {0: long_match(8), 1: weak_match(4)})
    seqs = [Seq(0), Seq(1)]
    for seq in seqs:
        ctrl.join([seq])
    assert sum(ctrl.plan(seqs).values()) > 3  # unbounded: the trusted match drafts long
    ks = ctrl.plan(seqs, max_rows=3)
    assert ks == {0: 3, 1: 0}
    assert ctrl.plan(seqs, max_rows=0) == {0: 0, 1: 0}


def serve(ctrl: SpeculationController, seqs: list[Seq], machine: dict[int, float],
          steps: int) -> list[list[int]]:
    """`steps` planned steps on a machine whose pass over k + 1 rows takes `machine[k]`: the
    cost model observes each pass as the engine does (every draft kept)."""
    history = []
    for _ in range(steps):
        planned = ctrl.plan(seqs)
        ks = [planned[s.seq_id] for s in seqs]
        ctrl.cost.observe_verify(len(seqs) + sum(ks) - 1, machine[len(seqs) + sum(ks) - 1])
        history.append(ks)
    return history


@pytest.mark.parametrize("batch", [1, 4])
def test_probes_correct_a_calibration_that_priced_every_draft_out(batch):
    """Start-up timed passes disturbed by another process priced every row beyond the
    batch's at 2.2x what it costs (as `calibration.py` saw two engines time each other):
    the matches here are not worth such rows, so none is verified and no larger pass is
    seen. Probes time one row more every PROBE_EVERY steps that left a slot out; after a
    few of them the prices are right and the engine drafts as one calibrated right does."""
    truth = {k: 0.025 * batch + 0.0025 * k for k in range(80)}
    disturbed = {k: s * (1.0 if k < batch else 2.2) for k, s in truth.items()}
    match = {i: Candidate(list(range(10, 18)), [0.8] * 8, 3) for i in range(batch)}
    seqs = [Seq(i) for i in range(batch)]

    def engine(calibration):
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=-1)
        ctrl = SpeculationController(spec, cost(calibration), [Lookup(match)])
        for seq in seqs:
            ctrl.join([seq])
        return ctrl

    right = sum(map(sum, serve(engine(truth), seqs, truth, 256)))
    assert right >= 256  # calibrated right, these matches draft
    ctrl = engine(disturbed)
    first = serve(ctrl, seqs, truth, PROBE_EVERY)
    assert [sum(ks) for ks in first] == [0] * (PROBE_EVERY - 1) + [1]  # the first probe
    serve(ctrl, seqs, truth, 9 * PROBE_EVERY)
    assert sum(map(sum, serve(ctrl, seqs, truth, 256))) >= 0.5 * right
    for rows in range(batch + 1, batch + 5):
        assert ctrl.cost.pass_time(rows) == pytest.approx(truth[rows - 1], rel=0.2)
    # without probes the same engine never drafts
    never = engine(disturbed)
    never.budget.probe_every = 1 << 30
    assert sum(map(sum, serve(never, seqs, truth, 10 * PROBE_EVERY))) == 0


def test_a_probe_costs_one_row_in_probe_every_steps_where_the_price_was_right():
    """Where the calibration was right (every row a decode step's worth) the probes verify
    one row per PROBE_EVERY steps, and what they time leaves the price where it was."""
    ctrl = controller(COMPUTE_BOUND, {0: weak_match()})
    seq = Seq(0)
    ctrl.join([seq])
    history = serve(ctrl, [seq], COMPUTE_BOUND, 10 * PROBE_EVERY)
    assert sum(ks[0] for ks in history) == 10 == ctrl.budget.probes
    assert ctrl.cost.pass_time(2) == pytest.approx(COMPUTE_BOUND[1], rel=0.02)
    # a step whose budget leaves nothing out (no match, or a fixed k) is never probed
    none = controller(COMPUTE_BOUND, {})
    fixed = controller(COMPUTE_BOUND, {0: weak_match()}, k=2)
    for ctrl in (none, fixed):
        ctrl.join([seq])
        serve(ctrl, [seq], COMPUTE_BOUND, 2 * PROBE_EVERY)
        assert ctrl.budget.probes == 0


def test_every_idle_reason_has_words_on_the_page_and_in_the_demo():
    """A round that drafted nothing is reported with its reason; the page and `make demo`
    put each reason in words, so a new reason must come with them."""
    from pathlib import Path

    import specserve.server
    from specserve.demo import IDLE_WORDS
    from specserve.speculative.controller import IDLE_REASONS

    page = (Path(specserve.server.__file__).parent / "static" / "app.js").read_text()
    words = page[page.index("const reasons = {"):]
    words = words[:words.index("};")]
    for reason in IDLE_REASONS:
        assert f"{reason}:" in words, reason
    assert set(IDLE_WORDS) == set(IDLE_REASONS)


def test_the_budgets_early_stop_chooses_what_trying_every_prefix_chooses():
    import random

    from specserve.speculative.budget import Offer

    rng = random.Random(1)
    stopped = drafted = 0
    for trial in range(300):
        slope = rng.choice((rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.6)))
        model = cost({k: 0.05 * (1 + slope * k) for k in range(33)})
        for _ in range(rng.randint(0, 40)):  # served passes: shape corrections, scales
            model.observe_verify(rng.randint(0, 24), 0.05 * rng.uniform(0.5, 4.0))
        offers, low = [], rng.choice((0.3, 0.9))
        for _ in range(rng.randint(1, 8)):
            reach, survival = 1.0, []
            for _ in range(rng.choice((0, 0, 1, 3, 8, 16))):
                reach *= rng.uniform(low, 1.0)
                survival.append(reach)
            forced = bool(survival) and rng.random() < 0.1
            offers.append(Offer(LOOKUP if survival else None, survival, forced))
        ctrl = controller(MODERATE, {})
        full = controller(MODERATE, {})
        ctrl.cost, full.cost = model, Unpruned(model)
        ctrl.budget.probe_every = full.budget.probe_every = 10 ** 9
        ctrl.budget.probe_down_every = full.budget.probe_down_every = 10 ** 9
        model.set_step(len(offers))
        asked = []
        step_seconds = ctrl.budget._step_seconds
        ctrl.budget._step_seconds = lambda *a: asked.append(1) or step_seconds(*a)
        chosen = ctrl.budget.choose(offers, len(offers), ctrl.cost)
        assert chosen == full.budget.choose(offers, len(offers), full.cost), trial
        drafted += sum(chosen) > sum(len(o.survival) for o in offers if o.forced)
        slots = sum(len(o.survival) for o in offers if not o.forced)
        stopped += len(asked) < slots + 1
    assert stopped > 30 and drafted > 30  # the early stop is taken, not only harmless


def test_downward_probes_stop_drafts_a_calibration_made_look_cheap():
    """At 8 sequences every extra row costs a row's worth of a plain pass (compute-bound), so
    one row with a survival below 1 never pays; but start-up timed the plain pass of the
    batch 12% dear, which made one draft row look nearly free. Drafting every step, the
    engine never times a plain pass again and drafts at a loss for ever, unless it probes
    down: once every PROBE_DOWN_EVERY steps that drafted, a step without its least likely
    slot times the smaller pass; after a few the price is right and drafting stops."""
    batch = 8
    truth = {k: 0.050 * max(1.0, (k + 1) / batch) for k in range(40)}
    dear = {k: (0.056 if k < batch else s) for k, s in truth.items()}
    match = {0: weak_match(1)}  # one slot in the batch, likely but not certain
    seqs = [Seq(i) for i in range(batch)]

    def engine(calibration, down_every=PROBE_DOWN_EVERY):
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=-1)
        ctrl = SpeculationController(spec, cost(calibration), [Lookup(match)])
        ctrl.budget.probe_down_every = down_every
        for seq in seqs:
            ctrl.join([seq])
        return ctrl

    right = engine(truth)
    assert sum(map(sum, serve(right, seqs, truth, 512))) == right.budget.probes <= 512 // PROBE_EVERY
    never = engine(dear, down_every=1 << 30)  # without downward probes: at a loss for ever
    assert sum(map(sum, serve(never, seqs, truth, 512))) >= 500
    ctrl = engine(dear)
    first = serve(ctrl, seqs, truth, PROBE_DOWN_EVERY)
    assert [sum(ks) for ks in first] == [1] * (PROBE_DOWN_EVERY - 1) + [0]  # the first probe
    serve(ctrl, seqs, truth, 12 * PROBE_DOWN_EVERY)
    assert ctrl.cost.pass_time(batch) == pytest.approx(truth[batch - 1], rel=0.05)
    late = serve(ctrl, seqs, truth, 512)
    assert sum(map(sum, late)) <= 512 // PROBE_EVERY + 1  # only the upward probes now


def test_a_downward_probe_waits_for_a_size_not_seen_lately():
    """Where the price is right and the smaller pass is never run otherwise (a trusted match
    drafts all it can every step), the downward probes drop one row once every
    PROBE_DOWN_EVERY drafting steps until that size was seen SEEN_LATELY times, then only as
    often as its weight fades (one observation's worth per ~128 steps): the price stays."""
    ctrl = controller(MEMORY_BOUND, {0: long_match(8)})
    seq = Seq(0)
    ctrl.join([seq])
    first = serve(ctrl, [seq], MEMORY_BOUND, int(SEEN_LATELY) * PROBE_DOWN_EVERY)
    assert [ks[0] for ks in first] == ([8] * (PROBE_DOWN_EVERY - 1) + [7]) * int(SEEN_LATELY)
    later = serve(ctrl, [seq], MEMORY_BOUND, 512)
    assert 1 <= sum(8 - ks[0] for ks in later) == ctrl.budget.probes_down - SEEN_LATELY <= 5
    assert ctrl.cost.pass_time(8) == pytest.approx(MEMORY_BOUND[7], rel=0.02)
    assert ctrl.cost.pass_time(9) == pytest.approx(MEMORY_BOUND[8], rel=0.02)


ROWS_30 = {k: 0.050 + 0.015 * k for k in range(64)}  # a row: 30% of a decode step


@pytest.mark.parametrize(("verify", "candidate", "ks_by_batch"), [
    (MEMORY_BOUND, long_match(), {1: 16, 4: 11, 8: 8}),  # the budget shares the rows evenly
    (MODERATE, long_match(), {1: 9, 4: 5, 8: 3}),
    (ROWS_30, long_match(8), {1: 5, 4: 2, 8: 0}),  # at eight, no row pays any more
    (MEMORY_BOUND, weak_match(), {1: 1, 4: 0, 8: 0}),
    (COMPUTE_BOUND, long_match(), {1: 0, 4: 0, 8: 0}),
    (MEMORY_BOUND, Candidate([], [], 0), {1: 0, 4: 0, 8: 0}),
])
def test_identical_requests_arriving_together_get_the_same_drafts(verify, candidate, ks_by_batch):
    """Identical requests sent at once (the same prompt, the same candidates): each gets the
    same k, none is starved by the budget, and the k shrinks as the batch makes rows dear."""
    for batch, k in ks_by_batch.items():
        ks = plan(controller(verify, {i: candidate for i in range(batch)}),
                  [Seq(i) for i in range(batch)])
        assert ks == [k] * batch, (batch, ks)


def test_identical_requests_whose_drafts_all_fail_stop_drafting_together():
    """Four identical requests whose drafts are always rejected (creative text at T = 0.7
    against a cache of earlier outputs) learn it from their own rounds alike: all draft less
    round by round, then stop and back off, and none keeps paying for rows that never survive."""
    match = Candidate([5, 6, 7, 8], [1.0] * 4, 2)
    ctrl = controller(MEMORY_BOUND, {i: match for i in range(4)})
    seqs = [Seq(i) for i in range(4)]
    for seq in seqs:
        ctrl.join([seq])
    history = run_rounds(ctrl, seqs, lambda seq, k: 0, 24)
    assert all(len(set(ks)) == 1 for ks in history), history  # alike in every round
    assert history[0][0] == 2 and all(ks[0] == 0 for ks in history[2:]), history
    assert all(ctrl.state(s).reason == "backed_off" and ctrl.state(s).fit.factor() < 1.0
               for s in seqs)


def test_in_a_batch_the_downward_probe_times_the_plain_pass_that_prices_every_draft():
    """Eight sequences with ~900-token contexts: every row costs its attention over the whole
    context (9 ms, a plain pass of 8 rows 72 ms), but the calibration (one sequence, a short
    prefix) made rows look nearly free and, scaled up by the large passes served, priced the
    plain pass at 106 ms. Three sequences copy (survival 0.6 a slot), drafting a row each:
    a probe of one row fewer times 10 rows, never the plain pass, and the engine drafts at a
    loss for ever. The plain probe times it; then the drafts that do not pay stop."""
    batch = 8
    truth = {k: 0.009 * max(batch, k + 1) for k in range(64)}
    dear = {k: 0.106 + 0.00275 * max(0, k + 1 - batch) for k in range(64)}
    match = {i: Candidate(list(range(10, 14)), [0.6] * 4, 3) for i in range(3)}
    seqs = [Seq(i) for i in range(batch)]

    def engine() -> SpeculationController:
        spec = SpeculativeConfig(method="suffix", num_speculative_tokens=-1)
        ctrl = SpeculationController(spec, cost(dear), [Lookup(match)])
        for seq in seqs:
            ctrl.join([seq])
        return ctrl

    ctrl = engine()
    first = serve(ctrl, seqs, truth, PROBE_DOWN_EVERY)
    assert sum(first[0]) == 3 and sum(first[-1]) == 0, first  # drafting, then a plain probe
    serve(ctrl, seqs, truth, 16 * PROBE_DOWN_EVERY)
    assert ctrl.cost.pass_time(batch) == pytest.approx(truth[batch - 1], rel=0.1)
    late = serve(ctrl, seqs, truth, 256)
    assert sum(map(sum, late)) <= 256 // PROBE_EVERY + 4, late[-8:]  # the losing drafts stopped
