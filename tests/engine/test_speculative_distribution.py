"""End to end through the engine (scheduler, caches, rollback, bonus) with bigram toy models:
the empirical law of short continuations matches the exact one."""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chisquare

from specserve.sampling.params import SamplingParams
from tests import toy

VOCAB, N_TOKENS, K, SAMPLES = 3, 4, 2, 6000
ALPHA = 1e-3


def empirical(engine, samples: int, seed: int, prompt: list[int]) -> Counter:
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=N_TOKENS, ignore_eos=True, seed=seed)
    engine.add_request(prompt, params)
    (out,) = toy.run_all(engine)
    return Counter(tuple(c.token_ids) for c in out.outputs)


def chi_square_p(counts: Counter, law: dict) -> float:
    keys = sorted(law)
    observed = [counts.get(s, 0) for s in keys]
    assert sum(observed) == sum(counts.values()), "engine produced a sequence of zero probability"
    total = sum(observed)
    return chisquare(observed, [law[s] * total for s in keys]).pvalue


@pytest.mark.parametrize("budget", [0.0, 0.4])
@pytest.mark.parametrize("bonus", [True, False])
def test_engine_continuations_follow_exact_law(budget, bonus):
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    engine = toy.toy_engine(P, Q, K, budget=budget, bonus=bonus)
    counts = empirical(engine, SAMPLES, seed=1234, prompt=[0, 1])
    law = toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K, budget=budget, bonus=bonus)
    assert chi_square_p(counts, law) > ALPHA
    if budget > 0:  # and it is not simply p's law: the budget was spent
        target_law = toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K, budget=0.0, bonus=bonus)
        assert chi_square_p(counts, target_law) < ALPHA


def test_ngram_drafter_is_lossless_under_sampling():
    """One-hot n-gram drafts through the same verifier keep the target's law (D = 0)."""
    P = toy.random_table(VOCAB, seed=3)
    engine = toy.toy_engine(P, None, K, method="ngram")
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # plenty of n-gram matches
    counts = empirical(engine, SAMPLES, seed=99, prompt=prompt)
    law = toy.exact_continuations(P, P, first=1, n=N_TOKENS, k=0, budget=0.0)  # = P's chain
    assert chi_square_p(counts, law) > ALPHA
    assert engine.metrics.total.drafted > 0, "the n-gram drafter never proposed anything"


def test_chi_square_detects_a_wrong_law():
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    engine = toy.toy_engine(P, Q, K)
    counts = empirical(engine, SAMPLES, seed=7, prompt=[0, 1])
    wrong = toy.exact_continuations(Q, Q, first=1, n=N_TOKENS, k=K, budget=0.0)
    assert chi_square_p(counts, wrong) < ALPHA


@pytest.mark.parametrize("budget", [0.0, 0.4])
def test_windowed_deferred_draft_keeps_the_exact_law(budget):
    """The draft starts after the target's prefill and is fed only the newest 3 tokens of a
    longer prompt (a hole in its context): the continuations still follow the exact law."""
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    engine = toy.toy_engine(P, Q, K, budget=budget)
    drafter = engine.spec.model
    drafter.prefill_window = 3
    drafter.max_prefill_tokens = 1024  # every start fits its call, so each drafts from round one
    started = []  # (skipped, ready) right after each start
    activate = drafter.activate
    drafter.activate = lambda seq: activate(seq) or started.append(
        (drafter._seqs[seq.seq_id].skipped, drafter.ready(seq)))
    prompt = [2, 0, 1, 2, 2, 0, 2, 1, 0, 1]
    counts = empirical(engine, SAMPLES, seed=4321, prompt=prompt)
    assert started == [(len(prompt) + 1 - 3, True)] * SAMPLES  # every draft from the window
    law = toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K, budget=budget, bonus=True)
    assert chi_square_p(counts, law) > ALPHA
