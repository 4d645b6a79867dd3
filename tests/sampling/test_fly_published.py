"""FLy as published (the authors' code, AMD-AGI/FLy `fly/models/FLy.py`) beside our variant:
its gate (unnormalized top-k entropy in nats of the raw softmax) on hand-computed rows, its
window (win_len counts the rejection and needs a further draft) against a transliteration of
the published mask arithmetic over every verdict pattern, no token condition, its settings,
a chi-square fit of its closed-form law, and its dispatch through the engine."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.sampling.fly import (FlySettings, _walk, fly_gate_distribution, gate_open,
                                    topk_entropy_nats, verify_fly)
from specserve.sampling.params import SamplingParams
from specserve.sampling.rejection import verify
from tests.sampling.oracles import residual_distribution
from tests.sampling.test_fly import UNSURE, rows, t64

ALPHA = 1e-3
GOOD = [0.9, 0.05, 0.05, 0.0]
FLAT = [0.25] * 4


def published(window: int, tau: float = 0.3, top_k: int = 3) -> FlySettings:
    return FlySettings(window, tau, top_k, "published")


def nats(*ps: float) -> float:
    return -sum(p * math.log(p) for p in ps if p > 0)


# ---------------------------------------------------------------- the gate

def test_gate_value_is_the_unnormalized_top_k_entropy_in_nats():
    got = topk_entropy_nats(rows([0.5, 0.3, 0.2, 0.0], [0.9, 0.05, 0.03, 0.02], FLAT), 3)
    expected = [nats(0.5, 0.3, 0.2), nats(0.9, 0.05, 0.03), 3 * nats(0.25)]
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx([1.0296530, 0.3498081, 1.0397208], abs=1e-6)


def test_the_two_gates_disagree_where_their_definitions_do():
    x = torch.tensor([0])
    # 0.93 / 0.035 / 0.035: 0.302 nats (published open), normalized 0.275 (ours shut)
    sure = rows([0.93, 0.035, 0.035, 0.0])
    assert gate_open(x, sure, published(1)) == [True]
    assert gate_open(x, sure, FlySettings(1, 0.3, 3)) == [False]
    # a flat tail of 94 tokens: the top 3 (0.04, 0.01, 0.01) hold 0.06 of the mass, so their
    # unnormalized entropy is 0.221 nats (published shut) but normalized 0.790 (ours open)
    tail = [0.04, 0.01, 0.01] + [0.94 / 94] * 94
    assert nats(0.04, 0.01, 0.01) == pytest.approx(0.2209, abs=1e-4)
    assert gate_open(x, rows(tail), published(1)) == [False]
    assert gate_open(x, rows(tail), FlySettings(1, 0.3, 3)) == [True]


def test_published_gate_has_no_token_condition():
    # x_0 = 3 has p_0(3) = 0 and is outside the top 3: ours refuses to defer it, published does
    target = rows(UNSURE, GOOD, FLAT)
    x, us = torch.tensor([3, 0]), [0.5, 0.1]
    out = verify_fly(x, None, target, us, 0.3, published(1))
    assert out.tokens == [3, 0, 1] and out.num_accepted == 2  # bonus: FLAT at u = 0.3
    assert out.tv_distances == pytest.approx([1.0, 0.0])  # 1 - p_0(3)
    assert verify_fly(x, None, target, us, 0.3, FlySettings(1, 0.0, 3)) == \
        verify(x, None, target, us, 0.3)


def test_published_gate_reads_the_raw_softmax_at_any_temperature():
    logits = t64([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    processed = torch.softmax(logits / 0.5, -1)  # what sampling at T = 0.5 would give
    raw = torch.softmax(logits.float(), -1)  # gate_distribution works in float32
    assert torch.equal(fly_gate_distribution(published(1), logits, processed, False), raw)
    assert fly_gate_distribution(FlySettings(1), logits, processed, False) is processed
    assert torch.equal(fly_gate_distribution(FlySettings(1), logits, processed, True), raw)


# ---------------------------------------------------------------- the window

def official_walk(native: list[bool], gate: list[bool], win_len: int) -> tuple[int, list[int]]:
    """The published mask arithmetic, transliterated: pattern [reject, accept * (win_len - 1)]
    matched on the native verdicts, the last win_len positions never deferred, then the gate
    turns shut-gate rejections back; the round keeps drafts up to the first False."""
    k = len(native)
    accepted = list(native)
    if k >= win_len:
        matched = [not native[j] and all(native[j + 1:j + win_len])
                   for j in range(k - win_len + 1)]
        accepted = [a or (j < len(matched) and matched[j]) for j, a in enumerate(accepted)]
        accepted[k - win_len:] = [a and n for a, n in zip(accepted[k - win_len:],
                                                          native[k - win_len:])]
    accepted = [a and (n or g) for a, n, g in zip(accepted, native, gate)]
    kept = accepted.index(False) if False in accepted else k
    return kept, [j for j in range(kept) if not native[j]]


@pytest.mark.parametrize("k", range(1, 8))
def test_walk_equals_the_published_mask_on_every_verdict_pattern(k):
    gen = np.random.default_rng(k)
    for native in itertools.product([True, False], repeat=k):
        for win_len in range(1, k + 2):
            for gate in ([True] * k, list(gen.random(k) < 0.5)):
                s = published(win_len)
                assert _walk(list(native), gate, s.agreeing, s.room) == \
                    official_walk(list(native), gate, win_len), (native, gate, win_len)


def test_win_len_counts_the_rejection_and_needs_a_further_draft():
    # native [reject, accept]: ours with W = 1 defers position 0; published win_len = 2 (one
    # agreeing verdict, like W = 1) does not: no draft follows the window
    target = rows(UNSURE, GOOD, FLAT)
    x, us = torch.tensor([1, 0]), [0.9, 0.1]
    assert verify_fly(x, None, target, us, 0.5, FlySettings(1, 0.3, 3)).num_accepted == 2
    assert verify_fly(x, None, target, us, 0.5, published(2)).num_accepted == 0
    # with a third draft (whatever its verdict) published win_len = 2 defers position 0
    target3 = rows(UNSURE, GOOD, GOOD, FLAT)
    out = verify_fly(torch.tensor([1, 0, 2]), None, target3, [0.9, 0.1, 0.99], 0.5, published(2))
    assert out.num_accepted == 2 and out.kind == "recovered"


# ---------------------------------------------------------------- settings

def test_published_settings_and_sampling_params():
    p = SamplingParams(fly_variant="published")
    assert FlySettings.of(p) == FlySettings(6, 0.3, 3, "published")
    assert FlySettings.of(SamplingParams(fly_variant="published", fly_window=3)).window == 3
    assert FlySettings.of(SamplingParams()) is None
    assert SamplingParams(fly_window=2).fly_variant == "specserve"
    assert published(1, tau=math.log(3)).entropy_threshold == pytest.approx(1.0986, abs=1e-4)
    with pytest.raises(ValueError, match="fly_entropy_threshold"):
        published(1, tau=1.1)  # above log 3
    with pytest.raises(ValueError, match="fly_entropy_threshold"):
        FlySettings(1, 1.05)  # ours is normalized: at most 1
    with pytest.raises(ValueError, match="fly_variant"):
        SamplingParams(fly_variant="paper")
    with pytest.raises(ValueError, match="fly_window"):
        SamplingParams(fly_variant="published", fly_window=0)


# ---------------------------------------------------------------- its law (chi-square)

P = rows([0.4, 0.35, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4], [0.6, 0.2, 0.1, 0.1], FLAT)
Q = rows([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1])


def test_published_first_token_matches_its_closed_form_law_chi_square():
    """k = 3, win_len = 2, gate open at position 0 (H_3(p_0) = 1.08 nats): position 0 defers
    when position 1 accepts (A_1 = sum_x q_1(x) a_1(x)), whatever its token, so
    P(y_0 = y) = q_0(y) [a_0(y) + (1 - a_0(y)) A_1] + R r_0(y) with
    R = sum_x q_0(x) (1 - a_0(x)) (1 - A_1): token 3, which p_0 gives no mass, is emitted."""
    p0, q0, p1, q1 = (t.numpy() for t in (P[0], Q[0], P[1], Q[1]))
    a0, a1 = np.minimum(1.0, p0 / q0), np.minimum(1.0, p1 / q1)
    big_a1 = float((q1 * a1).sum())
    r0 = residual_distribution(P[0], Q[0]).numpy()
    law = q0 * (a0 + (1 - a0) * big_a1) + (q0 * (1 - a0) * (1 - big_a1)).sum() * r0
    assert law.sum() == pytest.approx(1.0) and law[3] > 0.1 and p0[3] == 0
    rng = np.random.default_rng(9)
    n, k = 30_000, 3
    xs = np.stack([rng.choice(4, size=n, p=Q[i].numpy()) for i in range(k)], 1)
    us = rng.random((n, k + 1))
    counts = np.zeros(4)
    for j in range(n):
        out = verify_fly(torch.tensor(xs[j]), Q, P, us[j, :k].tolist(), float(us[j, k]),
                         published(2))
        counts[out.tokens[0]] += 1
    assert stats.chisquare(counts, n * law).pvalue > ALPHA
