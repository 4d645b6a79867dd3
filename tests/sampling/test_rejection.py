"""Tests for the rejection sampler: exact one-step laws by enumeration, chi-square fits of whole
rounds, boundary probes tying `verify` to the helpers, greedy verification and edge cases.

The reference math here is written independently in numpy, straight from the rules in the
`specserve/sampling/rejection.py` docstring.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.sampling import rejection
from specserve.sampling.rejection import VerifyResult, sample_from, verify, verify_greedy
from tests.sampling.oracles import (acceptance_probability, mentored_distribution,
                                    per_token_acceptance, residual_distribution, tv_distance)

BUDGETS = (0.0, 0.05, 0.3, 0.7, 1.0)
ALPHA = 1e-3


# ---------------------------------------------------------------- independent reference (numpy)

def reference_step(p: np.ndarray, q: np.ndarray, budget: float):
    """(pi, a, r) of one step, straight from the rules: a is only meaningful where q > 0."""
    d = 0.5 * np.abs(p - q).sum()
    theta = 1.0 if d == 0 else min(1.0, budget / d)
    pi = (1 - theta) * p + theta * q
    a = np.where(q > 0, np.minimum(1.0, pi / np.where(q > 0, q, 1.0)), 0.0)
    r = np.maximum(p - q, 0.0)
    r = r / r.sum() if r.sum() > 0 else p
    return pi, a, r


def one_step_law(q: np.ndarray, a: np.ndarray, r: np.ndarray) -> np.ndarray:
    """P(out = y) = q(y) a(y) + sum_x q(x) (1 - a(x)) r(y): enumerate every draft x ~ q."""
    rejected = sum(q[x] * (1 - a[x]) for x in range(len(q)))
    return np.array([q[y] * a[y] + rejected * r[y] for y in range(len(q))])


def t64(array) -> torch.Tensor:
    return torch.tensor(np.asarray(array), dtype=torch.float64)


def one_hot(vocab: int, index: int) -> np.ndarray:
    out = np.zeros(vocab)
    out[index] = 1.0
    return out


def distribution_pairs(seed: int = 0):
    """(name, p, q) over vocabularies of 3..8 tokens, including the awkward supports."""
    rng = np.random.default_rng(seed)
    pairs = []
    for vocab in range(3, 9):
        for _ in range(3):
            for conc_p, conc_q in [(0.1, 0.1), (0.5, 2.0), (1.0, 1.0), (5.0, 0.3), (20.0, 20.0)]:
                pair = rng.dirichlet([conc_p] * vocab), rng.dirichlet([conc_q] * vocab)
                pairs.append(("dirichlet", *pair))
            p = rng.dirichlet([1.0] * vocab)
            pairs.append(("one-hot q", p, one_hot(vocab, int(rng.integers(vocab)))))
            q = rng.dirichlet([1.0] * vocab)
            q[rng.choice(vocab, size=vocab // 2, replace=False)] = 0.0
            pairs.append(("q zero where p > 0", p, q / q.sum()))
            p_zero = rng.dirichlet([1.0] * vocab)
            p_zero[rng.choice(vocab, size=vocab // 2, replace=False)] = 0.0
            q = rng.dirichlet([1.0] * vocab)
            pairs.append(("p zero where q > 0", p_zero / p_zero.sum(), q))
            pairs.append(("p == q", p, p.copy()))
            pairs.append(("one-hot p", one_hot(vocab, 0), rng.dirichlet([1.0] * vocab)))
            pairs.append(("disjoint", one_hot(vocab, 0), one_hot(vocab, vocab - 1)))
    return pairs


PAIRS = distribution_pairs()


# ---------------------------------------------------------------- 1. exact one-step laws

@pytest.mark.parametrize("budget", BUDGETS)
def test_one_step_output_law_is_p_or_pi_exactly_by_enumeration(budget):
    for name, p_np, q_np in PAIRS:
        p, q = t64(p_np), t64(q_np)
        a = per_token_acceptance(p, q, budget).numpy()
        r = residual_distribution(p, q).numpy()
        pi = mentored_distribution(p, q, budget).numpy()
        law = one_step_law(q_np, a, r)  # production math
        ref_pi, ref_a, ref_r = reference_step(p_np, q_np, budget)
        ref_law = one_step_law(q_np, ref_a, ref_r)  # independent math

        expected = p_np if budget == 0.0 else ref_pi
        assert np.abs(law - expected).max() < 1e-9, name
        assert np.abs(ref_law - expected).max() < 1e-9, name
        assert np.abs(pi - ref_pi).max() < 1e-12, name
        support = q_np > 0
        assert np.abs(a[support] - ref_a[support]).max() < 1e-12, name
        if np.abs(p_np - q_np).sum() > 0:
            assert np.abs(r - ref_r).max() < 1e-12, name
        assert tv_distance(t64(pi), p) <= budget + 1e-12, name

        d = 0.5 * np.abs(p_np - q_np).sum()
        accepted_mass = float((q_np * a).sum())
        assert accepted_mass == pytest.approx(1 - max(0.0, d - budget), abs=1e-12), name
        assert acceptance_probability(p, q, budget) == pytest.approx(accepted_mass, abs=1e-12), name


def test_lossless_law_equals_p_for_every_pair_even_where_mentored_would_not():
    moved = 0
    for name, p_np, q_np in PAIRS:
        p, q = t64(p_np), t64(q_np)
        a, r = per_token_acceptance(p, q, 0.0).numpy(), residual_distribution(p, q).numpy()
        law = one_step_law(q_np, a, r)
        assert np.abs(law - p_np).max() < 1e-9, name
        moved += tv_distance(mentored_distribution(p, q, 0.3), p) > 0.1
    assert moved > len(PAIRS) // 2  # the D = 0.3 check above compares against a different law


def test_residual_of_p_equal_q_falls_back_to_p():
    p = t64([0.2, 0.3, 0.5])
    assert torch.equal(residual_distribution(p, p.clone()), p)
    assert per_token_acceptance(p, p.clone(), 0.0).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("budget", [0.0, 0.2, 0.6, 1.0])
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_verify_accepts_below_helper_acceptance_and_recovers_helper_residual(budget, one_hot_draft):
    """Probe verify's decision boundaries: uniforms[0] < a(x) accepts, above rejects, and each
    residual-uniform interval of the helper residual yields its token; so verify's one-step law is
    the enumerated law checked above."""
    rng = np.random.default_rng(1)
    rejections_probed = 0
    for _ in range(12):
        p_np, q_np, bonus = (rng.dirichlet([conc] * 5) for conc in (0.7, 0.7, 1.0))
        q_np[rng.integers(5)] = 0.0
        q_np /= q_np.sum()
        target = t64(np.stack([p_np, bonus]))  # [2, 5]
        for x in np.flatnonzero(q_np):
            q_row = t64(one_hot(5, x)) if one_hot_draft else t64(q_np)
            draft_probs = None if one_hot_draft else q_row[None]
            a = float(per_token_acceptance(target[0], q_row, budget)[x])

            def round_(u: float, ru: float = 0.5) -> VerifyResult:
                return verify(torch.tensor([x]), draft_probs, target, [u], ru, budget)

            if a > 1e-9:
                kept = round_(a - 1e-9)
                assert kept.num_accepted == 1 and kept.tokens[0] == x and kept.kind == "bonus"
            if a < 1 - 1e-9:
                assert round_(a + 1e-9).num_accepted == 0
                rejections_probed += 1
                residual = residual_distribution(target[0], q_row).numpy()
                edges = np.concatenate([[0.0], np.cumsum(residual)])
                for y in np.flatnonzero(residual > 1e-6):
                    out = round_(a + 1e-9, (edges[y] + edges[y + 1]) / 2)
                    assert out.tokens == [y] and out.kind == "recovered"
                    pi = mentored_distribution(target[0], q_row, budget)
                    realised = tv_distance(pi, target[0])
                    assert out.tv_distances == pytest.approx([realised], abs=1e-12)
    assert rejections_probed > 10 or budget == 1.0


# ---------------------------------------------------------------- 2. chi-square over whole rounds

ROUND_P = np.array([
    [0.40, 0.25, 0.20, 0.10, 0.05],
    [0.05, 0.10, 0.50, 0.15, 0.20],
    [0.30, 0.00, 0.30, 0.25, 0.15],  # p is zero where q is not
    [0.10, 0.20, 0.30, 0.25, 0.15],  # bonus position
])
ROUND_Q = np.array([
    [0.15, 0.35, 0.20, 0.25, 0.05],  # d = 0.25 <= 0.3: mentored accepts everything here
    [0.30, 0.30, 0.20, 0.20, 0.00],  # q is zero where p is not
    [0.20, 0.30, 0.10, 0.10, 0.30],
])
ROUND_K, ROUND_V = ROUND_Q.shape
NUM_ROUNDS = 100_000


def simulate_rounds(budget: float, seed: int,
                    num_rounds: int = NUM_ROUNDS) -> list[tuple[int, ...]]:
    """The emitted tokens of whole rounds: draft x_i ~ q_i, uniforms from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    draft_probs, target_probs = t64(ROUND_Q), t64(ROUND_P)
    drafts = torch.stack([torch.multinomial(draft_probs[i], num_rounds, True, generator=gen)
                          for i in range(ROUND_K)], dim=1)  # [rounds, k]
    uniforms = torch.rand(num_rounds, ROUND_K, generator=gen, dtype=torch.float64).tolist()
    residual_uniforms = torch.rand(num_rounds, generator=gen, dtype=torch.float64).tolist()
    with torch.inference_mode():
        return [tuple(verify(x, draft_probs, target_probs, u, ru, budget).tokens)
                for x, u, ru in zip(drafts.unbind(0), uniforms, residual_uniforms)]


@pytest.fixture(scope="module", params=[0.0, 0.3], ids=["lossless", "mentored-0.3"])
def rounds(request):
    budget = request.param
    return budget, simulate_rounds(budget, seed=1234 + int(budget * 10))


def position_laws(budget: float, wrong_residual: bool = False) -> np.ndarray:
    """[k + 1, V]: the law of the token emitted at each position given the round reached it:
    pi_i for drafted positions (p_i when D = 0), p_k for the bonus. `wrong_residual` gives the law
    of a broken sampler that recovers from p instead of the residual."""
    laws = []
    for i in range(ROUND_K):
        pi, a, r = reference_step(ROUND_P[i], ROUND_Q[i], budget)
        laws.append(one_step_law(ROUND_Q[i], a, ROUND_P[i] if wrong_residual else r))
        if not wrong_residual:
            assert np.abs(laws[-1] - (ROUND_P[i] if budget == 0 else pi)).max() < 1e-12
    laws.append(ROUND_P[ROUND_K])
    return np.array(laws)


def sequence_law(budget: float, wrong_residual: bool = False) -> dict[tuple[int, ...], float]:
    """Exact probability of every emitted token sequence (accepted drafts, then recovered/bonus)."""
    law = {}
    steps = [reference_step(ROUND_P[i], ROUND_Q[i], budget) for i in range(ROUND_K)]
    for j in range(ROUND_K + 1):
        for seq in product(range(ROUND_V), repeat=j + 1):
            prob = math.prod(ROUND_Q[i][seq[i]] * steps[i][1][seq[i]] for i in range(j))
            if j < ROUND_K:
                a, r = steps[j][1], (ROUND_P[j] if wrong_residual else steps[j][2])
                prob *= (ROUND_Q[j] * (1 - a)).sum() * r[seq[j]]
            else:
                prob *= ROUND_P[ROUND_K][seq[j]]
            if prob > 0:
                law[seq] = prob
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    return law


def per_position_pvalue(samples: list[tuple[int, ...]], laws: np.ndarray) -> float:
    """One chi-square over all k + 1 positions; position i counts rounds that reached it."""
    counts = np.zeros_like(laws)
    for seq in samples:
        for i, token in enumerate(seq):
            counts[i, token] += 1
    reached = counts.sum(1, keepdims=True)  # [k + 1, 1]
    expected = reached * laws
    keep = expected > 0
    if counts[~keep].any():  # a token the law forbids was emitted
        return 0.0
    groups = ROUND_K + 1  # each position's total is fixed by its own count
    return stats.chisquare(counts[keep], expected[keep], ddof=groups - 1).pvalue


def sequence_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Chi-square of whole emitted sequences; cells expecting fewer than 5 are pooled."""
    observed = Counter(samples)
    if not set(observed) <= set(law):  # a sequence the law forbids was emitted
        return 0.0
    big = [seq for seq, prob in law.items() if prob * len(samples) >= 5]
    small = set(law) - set(big)
    obs = [observed[s] for s in big]
    exp = [law[s] * len(samples) for s in big]
    if small:
        obs.append(sum(observed[s] for s in small))
        exp.append(sum(law[s] for s in small) * len(samples))
    return stats.chisquare(obs, exp).pvalue


def test_round_tokens_follow_p_or_pi_at_every_position_including_bonus(rounds):
    budget, samples = rounds
    assert len(samples) >= 100_000
    assert per_position_pvalue(samples, position_laws(budget)) > ALPHA


def test_round_sequences_follow_the_exact_joint_law(rounds):
    budget, samples = rounds
    assert sequence_pvalue(samples, sequence_law(budget)) > ALPHA


def test_round_accept_counts_match_one_minus_excess_tv(rounds):
    budget, samples = rounds
    tvs = 0.5 * np.abs(ROUND_P[:ROUND_K] - ROUND_Q).sum(1)  # [k]
    alphas = [1 - max(0.0, d - budget) for d in tvs]
    reach = np.cumprod([1.0] + alphas)  # P(num_accepted >= j)
    expected = np.append(reach[:-1] - reach[1:], reach[-1]) * len(samples)
    observed = np.bincount([len(seq) - 1 for seq in samples], minlength=ROUND_K + 1)
    possible = expected > 0  # with D = 0.3 the first draft is always accepted (d = 0.25 <= D)
    assert observed[~possible].sum() == 0
    assert stats.chisquare(observed[possible], expected[possible]).pvalue > ALPHA


def test_chi_square_rejects_the_wrong_law_so_the_fit_tests_can_fail(rounds):
    budget, samples = rounds
    broken = position_laws(budget, wrong_residual=True)  # recovering from p: a classic bug
    assert per_position_pvalue(samples, broken) < ALPHA
    assert sequence_pvalue(samples, sequence_law(budget, wrong_residual=True)) < ALPHA
    other = 0.3 if budget == 0.0 else 0.0  # lossless samples are not mentored ones, and back
    assert per_position_pvalue(samples, position_laws(other)) < ALPHA


def recover_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p.clone()


def accept_with_inverted_ratio(pi_x: float, q_x: float) -> float:
    return min(1.0, q_x / pi_x) if pi_x > 0 else 1.0


@pytest.mark.parametrize("bug", [recover_from_p, accept_with_inverted_ratio])
def test_chi_square_catches_a_broken_sampler(monkeypatch, bug):
    """Mutation check: break one line of the sampler and the lossless fit must reject it."""
    target = "_residual_mass" if bug is recover_from_p else "_accept_prob"
    monkeypatch.setattr(rejection, target, bug)
    samples = simulate_rounds(0.0, seed=99, num_rounds=10_000)
    assert per_position_pvalue(samples, position_laws(0.0)) < ALPHA


# ---------------------------------------------------------------- 3. budgets, greedy, k = 0

def test_budget_one_accepts_every_draft_token_whatever_p_says():
    rng = np.random.default_rng(2)
    for _ in range(50):
        vocab, k = int(rng.integers(3, 9)), int(rng.integers(1, 6))
        target = t64(rng.dirichlet([0.3] * vocab, size=k + 1))  # [k + 1, V]
        target[:k, 0] = 0.0  # p(x) = 0 is still accepted below when x = 0 is drafted
        draft = t64(rng.dirichlet([0.3] * vocab, size=k))  # [k, V]
        x = torch.tensor([int(rng.choice(vocab, p=row / row.sum())) for row in draft.numpy()])
        near_one = [1 - 1e-12] * k
        for draft_probs in (draft, None):
            out = verify(x, draft_probs, target, near_one, 0.5, tv_budget=1.0)
            assert out.num_accepted == k and out.tokens[:k] == x.tolist() and out.kind == "bonus"
        assert torch.all(per_token_acceptance(target[0], draft[0], 1.0)[draft[0] > 0] == 1.0)


def test_lossless_one_hot_draft_is_accepted_with_probability_p_of_the_token():
    p = t64([0.1, 0.6, 0.0, 0.3])
    target = torch.stack([p, t64([0.25] * 4)])  # [2, 4]
    for x, px in enumerate(p.tolist()):
        assert float(per_token_acceptance(p, t64(one_hot(4, x)), 0.0)[x]) == px
        if px > 0:
            assert verify(torch.tensor([x]), None, target, [px - 1e-12], 0.5).num_accepted == 1
        assert verify(torch.tensor([x]), None, target, [px], 0.5).num_accepted == 0 or px == 1.0
    residual = residual_distribution(p, t64(one_hot(4, 1)))  # p with the draft token removed
    assert residual.tolist() == pytest.approx([0.25, 0.0, 0.0, 0.75], abs=1e-15)


def test_one_hot_drafts_match_dense_one_hot_draft_probs_in_mentored_rounds():
    rng = np.random.default_rng(3)
    for _ in range(40):
        k, vocab = 4, 6
        target = t64(rng.dirichlet([0.5] * vocab, size=k + 1))  # [k + 1, V]
        x = torch.tensor(rng.integers(vocab, size=k))
        dense = torch.nn.functional.one_hot(x, vocab).double()  # [k, V]
        u, ru, budget = rng.random(k).tolist(), float(rng.random()), float(rng.choice([0.1, 0.4]))
        a = verify(x, None, target, u, ru, budget)
        b = verify(x, dense, target, u, ru, budget)
        assert (a.tokens, a.num_accepted, a.kind) == (b.tokens, b.num_accepted, b.kind)
        assert a.tv_distances == pytest.approx(b.tv_distances, abs=1e-12)


def test_tv_distances_are_realised_theta_d_up_to_and_including_the_rejection():
    rng = np.random.default_rng(4)
    target = t64(rng.dirichlet([0.5] * 5, size=5))  # [5, 5]
    draft = t64(rng.dirichlet([0.5] * 5, size=4))  # [4, 5]
    x = torch.tensor([int(row.argmax()) for row in draft])
    u = [0.0, 0.0, 1 - 1e-12, 0.0]  # the third draft is rejected unless a = 1
    for budget in (0.0, 0.1, 0.5):
        out = verify(x, draft, target, u, 0.3, tv_budget=budget)
        expected = [tv_distance(mentored_distribution(target[i], draft[i], budget), target[i])
                    for i in range(len(out.tv_distances))]
        assert out.tv_distances == pytest.approx(expected, abs=1e-12)
        assert all(t <= budget + 1e-12 for t in out.tv_distances)
        assert len(out.tv_distances) == out.num_accepted + (out.kind == "recovered")
    lossless = verify(x, draft, target, u, 0.3, tv_budget=0.0)
    assert lossless.tv_distances == [0.0] * (lossless.num_accepted + (lossless.kind == "recovered"))


def test_chunked_tv_walk_gives_the_same_rounds_as_one_chunk(monkeypatch):
    rng = np.random.default_rng(5)
    cases = []
    for _ in range(30):
        target = t64(rng.dirichlet([0.5] * 5, size=6))  # [6, 5]
        draft = t64(rng.dirichlet([0.5] * 5, size=5))  # [5, 5]
        x = torch.tensor([int(rng.choice(5, p=row)) for row in draft.numpy()])
        cases.append((x, draft, target, rng.random(5).tolist(), float(rng.random())))
    whole = [verify(*case, tv_budget=0.35) for case in cases]
    monkeypatch.setattr(rejection, "CHUNK_ELEMENTS", 7)  # one row of 5 per chunk
    assert [verify(*case, tv_budget=0.35) for case in cases] == whole


def test_bonus_disabled_emits_only_the_accepted_drafts():
    target = t64([[0.1, 0.9], [0.2, 0.8], [0.7, 0.3]])  # [3, 2]
    x = torch.tensor([1, 1])
    out = verify(x, None, target, [0.0, 0.0], 0.99, bonus_token=False)
    assert out == VerifyResult([1, 1], 2, "none", [0.0, 0.0])
    with_bonus = verify(x, None, target, [0.0, 0.0], 0.99)
    assert with_bonus == VerifyResult([1, 1, 1], 2, "bonus", [0.0, 0.0])
    rejected = verify(x, None, target, [0.0, 0.95], 0.5, bonus_token=False)
    assert rejected == VerifyResult([1, 0], 1, "recovered", [0.0, 0.0])


def test_k_zero_round_is_a_plain_sample_from_the_first_target_row():
    p = t64([0.2, 0.0, 0.5, 0.3])
    edges = np.concatenate([[0.0], np.cumsum(p.numpy())])
    no_drafts = torch.tensor([], dtype=torch.long)
    for bonus in (True, False):
        for y in (0, 2, 3):
            middle = (edges[y] + edges[y + 1]) / 2
            out = verify(no_drafts, None, p[None], [], middle, tv_budget=0.5, bonus_token=bonus)
            assert out == VerifyResult([y], 0, "bonus", [])
        greedy = verify_greedy(no_drafts, p[None], bonus_token=bonus)
        assert greedy == VerifyResult([2], 0, "bonus", [])


def test_greedy_accepts_all_and_adds_the_bonus_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.0], [0.0, 0.0, 5.0]])  # [3, 3]
    drafts = torch.tensor([1, 0])
    assert verify_greedy(drafts, logits) == VerifyResult([1, 0, 2], 2, "bonus", [0.0, 0.0])
    without_bonus = verify_greedy(drafts, logits, bonus_token=False)
    assert without_bonus == VerifyResult([1, 0], 2, "none", [0.0, 0.0])


def test_greedy_first_position_mismatch_emits_the_target_argmax_only():
    probs = t64([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4]])  # [3, 3]
    assert verify_greedy(torch.tensor([2, 0]), probs) == VerifyResult([1], 0, "recovered", [0.0])
    second = verify_greedy(torch.tensor([1, 2]), probs)
    assert second == VerifyResult([1, 0], 1, "recovered", [0.0, 0.0])


def test_greedy_ties_go_to_the_lowest_index():
    probs = t64([[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]])  # [2, 3]
    assert verify_greedy(torch.tensor([1]), probs).tokens == [0]
    assert verify_greedy(torch.tensor([0]), probs).tokens == [0, 1]


def test_invalid_arguments_raise_value_errors_naming_the_field():
    target = t64([[0.5, 0.5], [0.5, 0.5]])  # [2, 2]
    x = torch.tensor([0])
    for budget in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match="tv_budget"):
            verify(x, None, target, [0.5], 0.5, tv_budget=budget)
        with pytest.raises(ValueError, match="tv_budget"):
            mentored_distribution(target[0], target[1], budget)
    with pytest.raises(ValueError, match="target_probs"):
        verify(torch.tensor([0, 1]), None, target, [0.5, 0.5], 0.5)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(x, t64([[1.0, 0.0, 0.0]]), target, [0.5], 0.5)
    with pytest.raises(ValueError, match="uniforms"):
        verify(x, None, target, [1.0], 0.5)
    with pytest.raises(ValueError, match="uniforms"):
        verify(x, None, target, [0.1, 0.2], 0.5)
    with pytest.raises(ValueError, match="residual_uniform"):
        verify(x, None, target, [0.5], -0.1)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(torch.tensor([2]), None, target, [0.5], 0.5)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_greedy(torch.tensor([0.0]), target)
    with pytest.raises(ValueError, match="kind"):
        VerifyResult([1], 0, "accepted", [])
    with pytest.raises(ValueError, match="tokens"):
        VerifyResult([1, 2], 0, "recovered", [0.0])


# ---------------------------------------------------------------- 4. sample_from

def test_sample_from_never_returns_a_zero_probability_index():
    probs = t64([0.0, 0.5, 0.0, 0.5, 0.0])
    assert sample_from(probs, 0.0) == 1
    assert sample_from(probs, 0.5) == 3  # exactly on the boundary after index 1: skip index 2
    assert sample_from(probs, 0.4999999) == 1
    assert sample_from(probs, 0.999999) == 3
    assert sample_from(probs, math.nextafter(1.0, 0.0)) == 3
    assert sample_from(t64([0.0, 0.0, 1.0]), 0.0) == 2
    unnormalized = torch.tensor([0.0, 2.0, 0.0, 2.0])  # float32, total 4
    assert sample_from(unnormalized, torch.tensor(0.5)) == 3

    rng = np.random.default_rng(6)
    for _ in range(200):
        raw = rng.dirichlet([0.2] * 40) * (rng.random(40) < 0.5)
        if raw.sum() == 0:
            continue
        probs = t64(raw) if rng.random() < 0.5 else torch.tensor(raw, dtype=torch.float32)
        cdf = np.cumsum(probs.double().numpy())
        boundaries = cdf / cdf[-1]
        us = [0.0, math.nextafter(1.0, 0.0)] + [b for b in boundaries if b < 1.0]
        us += [math.nextafter(b, 0.0) for b in boundaries if 0.0 < b < 1.0]
        for u in us:
            assert float(probs[sample_from(probs, u)]) > 0, (raw, u)


@pytest.mark.parametrize("vocab", [1023, 1024, 1025, 3 * 1024, 5000, 151936])
def test_sample_from_across_blocks_is_one_cumulative_sum(vocab):
    """The two-level inverse CDF (block masses, then one block) picks the index a single
    float64 cumulative sum over the vocabulary picks, wherever u * total is not within
    rounding of a boundary; at the boundaries (block edges and empty blocks included) it never
    picks a zero-mass index."""
    rng = np.random.default_rng(vocab)
    for trial in range(6):
        raw = rng.dirichlet([0.3] * vocab) * (rng.random(vocab) < 0.6)
        if trial % 2:  # whole blocks without mass, and mass right at a block's first entry
            raw[1024:2048] = 0.0
            raw[min(2048, vocab - 1)] = 0.1
        probs = torch.tensor(raw, dtype=torch.float32 if trial % 3 else torch.float64)
        cdf = np.cumsum(probs.double().numpy())
        total = cdf[-1]
        for u in rng.random(300):
            target = u * total
            expected = int(np.searchsorted(cdf, target, side="right"))
            near = np.abs(cdf[max(expected - 1, 0):expected + 1] - target).min()
            if near > 1e-12 * total:
                assert sample_from(probs, u) == expected, (trial, u)
        edges = cdf[1023::1024] / total  # block ends, as fractions of the total
        for b in [*edges, *cdf[rng.integers(0, vocab, 50)] / total]:
            for u in (b, math.nextafter(b, 0.0)):
                if 0.0 <= u < 1.0:
                    assert float(probs[sample_from(probs, u)]) > 0, (trial, u)


def test_sample_from_maps_uniform_intervals_to_their_tokens():
    probs = t64([0.125, 0.0, 0.375, 0.25, 0.0, 0.25])
    grid = (np.arange(8000) + 0.5) / 8000
    picks = np.bincount([sample_from(probs, u) for u in grid], minlength=6) / len(grid)
    assert np.abs(picks - probs.numpy()).max() < 1e-3


def test_sample_from_rejects_bad_input():
    for bad in (t64([0.0, 0.0]), t64([0.5, -0.1, 0.6]), t64([[0.5, 0.5]]), t64([math.inf, 1.0])):
        with pytest.raises(ValueError, match="probs"):
            sample_from(bad, 0.5)
    for u in (1.0, -1e-9):
        with pytest.raises(ValueError, match="uniform"):
            sample_from(t64([1.0]), u)
