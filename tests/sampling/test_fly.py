"""Tests for FLy verification: its acceptance rule on hand-built rounds (deferral, each
condition that refuses one, two deferrals in a round, greedy), its settings' checks, that it
never accepts fewer drafts than the native rule, a chi-square fit of its closed-form law, and
that with no room to defer it is the lossless rule exactly (identical rounds, chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.sampling.fly import FlySettings, verify_fly
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import verify
from tests.sampling.oracles import residual_distribution

ALPHA = 1e-3
UNSURE = [0.4, 0.35, 0.25, 0.0]  # top-3 entropy 0.98
SURE = [0.97, 0.01, 0.01, 0.01]  # top-3 entropy 0.10


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def rows(*dists) -> torch.Tensor:
    return t64([list(d) for d in dists])


FLAT = [0.25] * 4
W1 = FlySettings(window=1, entropy_threshold=0.3, top_k=3)


# ---------------------------------------------------------------- exact rounds (one-hot drafts)

def test_unsure_rejection_with_agreeing_window_is_deferred():
    # x_0 = 1 has p_0(1) = 0.35 < u_0 = 0.9: the native rule rejects it; the target is unsure
    # (h = 0.98 >= 0.3), x_0 is in its top 3, and position 1 (u 0.1 < 0.8) agrees
    target = rows(UNSURE, [0.8, 0.1, 0.1, 0.0], [0.1, 0.1, 0.5, 0.3], FLAT)
    x = torch.tensor([1, 0, 2])
    out = verify_fly(x, None, target, [0.9, 0.1, 0.2], 0.6, W1)
    assert out.tokens == [1, 0, 2, 2] and out.num_accepted == 3 and out.kind == "bonus"
    assert out.tv_distances == pytest.approx([0.65, 0.0, 0.0])  # 1 - p_0(x_0) at the deferral
    native = verify(x, None, target, [0.9, 0.1, 0.2], 0.6)
    assert native.num_accepted == 0 and native.kind == "recovered"


@pytest.mark.parametrize("case", ["sure target", "window disagrees", "no room for the window",
                                  "draft outside the top-k", "draft without target mass"])
def test_each_condition_alone_refuses_the_deferral(case):
    first, x, us, settings = UNSURE, [1, 0, 2], [0.9, 0.1, 0.2], W1
    if case == "sure target":
        first = SURE
    elif case == "window disagrees":
        us = [0.9, 0.95, 0.2]
    elif case == "no room for the window":
        settings = FlySettings(window=3, entropy_threshold=0.3, top_k=3)  # 0 + 3 < 3 fails
    elif case == "draft outside the top-k":
        settings = FlySettings(window=1, entropy_threshold=0.3, top_k=2)  # top 2 = {0, 1}
        x = [2, 0, 2]
    elif case == "draft without target mass":
        settings = FlySettings(window=1, entropy_threshold=0.0, top_k=4)
        x = [3, 0, 2]  # p_0(3) = 0 yet in the "top 4" of a 4-token vocabulary
    target = rows(first, [0.8, 0.1, 0.1, 0.0], [0.1, 0.1, 0.5, 0.3], FLAT)
    out = verify_fly(torch.tensor(x), None, target, us, 0.6, settings)
    assert out == verify(torch.tensor(x), None, target, us, 0.6)
    assert out.num_accepted == 0 and out.kind == "recovered"


def test_last_positions_cannot_defer_and_rejection_there_stops_the_round():
    # native verdicts [accept, accept, reject]: position 2 has no draft after it
    target = rows([0.9, 0.1, 0, 0], [0.9, 0.1, 0, 0], UNSURE, FLAT)
    x, us = torch.tensor([0, 0, 1]), [0.1, 0.1, 0.9]
    assert verify_fly(x, None, target, us, 0.3, W1) == verify(x, None, target, us, 0.3)


def test_two_deferrals_in_one_round_and_a_chain_is_not_deferred():
    good = [0.9, 0.05, 0.05, 0.0]
    target = rows(UNSURE, good, UNSURE, good, good, FLAT)
    x = torch.tensor([1, 0, 1, 0, 0])
    out = verify_fly(x, None, target, [0.9, 0.1, 0.9, 0.1, 0.1], 0.1, W1)
    assert out.num_accepted == 5 and out.tokens[:5] == [1, 0, 1, 0, 0]
    assert out.tv_distances == pytest.approx([0.65, 0.0, 0.65, 0.0, 0.0])
    # rejections at 0 and 1 back to back: the window after 0 disagrees, so 0 is not deferred
    chain = verify_fly(x, None, target, [0.9, 0.99, 0.9, 0.1, 0.1], 0.1, W1)
    assert chain.num_accepted == 0 and chain.kind == "recovered"


def test_window_two_needs_both_later_verdicts():
    good = [0.9, 0.05, 0.05, 0.0]
    target = rows(UNSURE, good, good, good, FLAT)
    x = torch.tensor([1, 0, 0, 0])
    w2 = FlySettings(window=2, entropy_threshold=0.3, top_k=3)
    assert verify_fly(x, None, target, [0.9, 0.1, 0.1, 0.95], 0.5, w2).num_accepted == 3
    refused = verify_fly(x, None, target, [0.9, 0.1, 0.95, 0.1], 0.5, w2)
    assert refused.num_accepted == 0


def test_greedy_rounds_read_the_gate_from_raw_probabilities():
    # greedy: one-hot target rows at the argmax, one-hot drafts; the raw softmax is unsure
    raw = rows([0.36, 0.34, 0.30, 0.0], [0.1, 0.8, 0.1, 0.0], [0.7, 0.1, 0.1, 0.1])
    target = rows([1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0])
    x = torch.tensor([1, 1])
    out = verify_fly(x, None, target, [0.0, 0.0], 0.0, W1, gate_probs=raw)
    assert out.tokens == [1, 1, 0] and out.tv_distances == [1.0, 0.0]
    assert verify_fly(x, None, target, [0.0, 0.0], 0.0, W1).num_accepted == 0  # one-hot: sure


def test_fly_keeps_the_native_mentored_tv_where_the_native_rule_decided():
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        target = torch.softmax(torch.randn(5, 6, generator=gen, dtype=torch.float64), -1)
        draft = torch.softmax(torch.randn(4, 6, generator=gen, dtype=torch.float64), -1)
        x = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        u = torch.rand(4, generator=gen, dtype=torch.float64).tolist()
        native = verify(x, draft, target, u, 0.4, 0.2)
        out = verify_fly(x, draft, target, u, 0.4, W1, tv_budget=0.2)
        assert out.num_accepted >= native.num_accepted  # FLy never keeps fewer
        n = native.num_accepted
        assert out.tv_distances[:n] == native.tv_distances[:n]
        if out.num_accepted == n:
            assert out == native


# ---------------------------------------------------------------- settings

def test_settings_are_checked_and_off_by_default():
    assert FlySettings.of(SamplingParams()) is None
    assert FlySettings.of(SamplingParams(fly_window=2, fly_entropy_threshold=0.5, fly_top_k=4)) \
        == FlySettings(2, 0.5, 4)
    for kw, field in [(dict(window=0), "fly_window"), (dict(window=1.0), "fly_window"),
                      (dict(window=1, entropy_threshold=1.2), "fly_entropy_threshold"),
                      (dict(window=1, entropy_threshold=float("nan")), "fly_entropy_threshold"),
                      (dict(window=1, top_k=1), "fly_top_k")]:
        with pytest.raises(ValueError, match=field):
            FlySettings(**kw)
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{"fly_" + name: value for name, value in kw.items()})
    with pytest.raises(ValueError, match="tv_entropy_top_k"):
        SamplingParams(tv_entropy_top_k=1)


def test_gate_probs_shape_is_checked():
    target = rows(UNSURE, FLAT)
    with pytest.raises(ValueError, match="gate_probs"):
        verify_fly(torch.tensor([1]), None, target, [0.5], 0.5, W1, gate_probs=t64([[0.5, 0.5]]))


# ---------------------------------------------------------------- laws (chi-square)

def _sample_rounds(p, q, settings, n, seed, gate=None):
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    xs = np.stack([rng.choice(p.shape[1], size=n, p=q[i].numpy()) for i in range(k)], 1)
    us = rng.random((n, k + 1))
    counts = np.zeros((k + 1, p.shape[1]))
    for j in range(n):
        out = verify_fly(torch.tensor(xs[j]), q, p, us[j, :k].tolist(), float(us[j, k]), settings,
                         gate_probs=gate)
        for i, token in enumerate(out.tokens):
            counts[i, token] += 1
    return counts


P = rows([0.4, 0.35, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4], [0.6, 0.2, 0.1, 0.1])
Q = rows([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25])


def test_fly_first_token_matches_its_closed_form_law_chi_square():
    """k = 2, W = 1: only position 0 can defer. With A_1 = sum_x q_1(x) a_1(x) the chance
    that position 1 agrees and G(y) the gate at y, P(y_0 = y) = q_0(y) [a_0(y) + (1 - a_0(y))
    G(y) A_1] + R r_0(y), R = sum_x q_0(x) (1 - a_0(x)) (1 - G(x) A_1)."""
    p0, q0, p1, q1 = (t.numpy() for t in (P[0], Q[0], P[1], Q[1]))
    a0 = np.minimum(1.0, p0 / q0)
    a1 = np.minimum(1.0, p1 / q1)
    big_a1 = float((q1 * a1).sum())
    gate = np.array([1.0, 1.0, 1.0, 0.0])  # h_3(p_0) = 0.98; tokens 0..2 are its top 3, p_0(3) = 0
    r0 = residual_distribution(P[0], Q[0]).numpy()
    law = q0 * (a0 + (1 - a0) * gate * big_a1) + (q0 * (1 - a0) * (1 - gate * big_a1)).sum() * r0
    assert law.sum() == pytest.approx(1.0)
    assert np.abs(law - p0).sum() > 0.05  # the law differs from the target's: FLy is lossy
    counts = _sample_rounds(P, Q, W1, 40_000, seed=5)
    expected = counts[0].sum() * law
    keep = expected > 0
    assert counts[0][~keep].sum() == 0
    assert stats.chisquare(counts[0][keep], expected[keep]).pvalue > ALPHA
    lossless = counts[0].sum() * p0
    assert stats.chisquare(counts[0][keep], lossless[keep]).pvalue < 1e-9  # and the test can tell


def test_fly_with_no_room_to_defer_is_the_lossless_rule():
    """W >= k: no window fits, so every round equals `verify`'s, and each emitted token
    follows the target's law p_i at its position (chi-square over all k + 1 outputs)."""
    off = FlySettings(window=2, entropy_threshold=0.0, top_k=4)
    gen = torch.Generator().manual_seed(6)
    for _ in range(500):
        target = torch.softmax(torch.randn(3, 5, generator=gen, dtype=torch.float64) * 2, -1)
        draft = torch.softmax(torch.randn(2, 5, generator=gen, dtype=torch.float64) * 2, -1)
        x = torch.multinomial(draft, 1, generator=gen).squeeze(1)
        u = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
        assert verify_fly(x, draft, target, u, 0.7, off) == verify(x, draft, target, u, 0.7)
    counts = _sample_rounds(P, Q, off, 40_000, seed=7)
    for i in range(3):
        expected = counts[i].sum() * P[i].numpy()
        keep = expected > 0
        assert counts[i][~keep].sum() == 0
        assert stats.chisquare(counts[i][keep], expected[keep]).pvalue > ALPHA


def test_walk_defers_only_with_a_whole_agreeing_window():
    from specserve.sampling.fly import _walk

    T, F = True, False
    assert _walk([T, F, T, T, F], [F, T, F, F, T], 2, 2) == (4, [1])  # the docstring's example
    assert _walk([T, T, T], [F, F, F], 1, 1) == (3, [])
    assert _walk([F, T, F, T], [T, F, T, F], 1, 1) == (4, [0, 2])
    assert _walk([F, T, F, T], [F, F, T, F], 1, 1) == (0, [])  # gate shut at 0
    assert _walk([F, T], [T, F], 2, 2) == (0, [])  # W = 2 does not fit after position 0 of 2
    assert _walk([], [], 1, 1) == (0, [])
