"""End to end through the engine (scheduler, caches, rollback, bonus) with bigram toy models:
the empirical law of short continuations matches the exact one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specserve.sampling.params import SamplingParams
from tests import toy

VOCAB, N_TOKENS, K, SAMPLES = 3, 4, 2, 6000
ALPHA = 1e-3


def empirical(engine, samples: int, seed: int, prompt: list[int], **sampling) -> Counter:
    sampling = {"temperature": 1.0, **sampling}
    params = SamplingParams(n=samples, max_tokens=N_TOKENS, ignore_eos=True, seed=seed, **sampling)
    engine.add_request(prompt, params)
    (out,) = toy.run_all(engine)
    return Counter(tuple(c.token_ids) for c in out.outputs)


def chi_square_p(counts: Counter, law: dict, min_expected: float = 0.0) -> float:
    """χ² p-value of `counts` against `law`; cells expected below `min_expected` counts are
    pooled into one (the χ² approximation needs a few expected counts per cell: a single
    sample of a continuation expected 0.01 times would otherwise decide the test alone)."""
    keys = sorted(s for s, p in law.items() if p > 0)  # a sample elsewhere fails the check below
    observed = [counts.get(s, 0) for s in keys]
    assert sum(observed) == sum(counts.values()), "engine produced a sequence of zero probability"
    total = sum(observed)
    expected = [law[s] * total for s in keys]
    small = [i for i, e in enumerate(expected) if e < min_expected]
    if small:
        pooled_o, pooled_e = sum(observed[i] for i in small), sum(expected[i] for i in small)
        keep = [i for i in range(len(keys)) if i not in set(small)]
        observed = [observed[i] for i in keep] + [pooled_o]
        expected = [expected[i] for i in keep] + [pooled_e]
    return chisquare(observed, expected).pvalue


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


def processed_table(table: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Each row of a bigram table as the engine's processing leaves it, written out here: the
    logits log p divided by the temperature, softmax, then the smallest set of most likely
    tokens whose mass reaches top_p, renormalised."""
    p = table.double() / table.double().sum(-1, keepdim=True)
    p = torch.softmax(p.log() / temperature, dim=-1)  # [vocab, vocab]
    out = torch.zeros_like(p)
    for r in range(p.shape[0]):
        order = torch.argsort(p[r], descending=True)
        mass_before = torch.cumsum(p[r, order], 0) - p[r, order]
        keep = order[mass_before < top_p]
        out[r, keep] = p[r, keep] / p[r, keep].sum()
    return out


@pytest.mark.parametrize("budget", [0.0, 0.4])
def test_engine_continuations_follow_the_processed_law_at_t_0_7_and_top_p_0_9(budget):
    """Temperature 0.7 and top-p 0.9 process the target's and the draft's rows alike; the
    continuations follow the exact law of the processed tables (lossless: the processed
    target's chain), and not that of the raw ones."""
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    P2, Q2 = processed_table(P, 0.7, 0.9), processed_table(Q, 0.7, 0.9)
    assert (P2 == 0).any(), "top_p 0.9 must drop a token somewhere, or the case proves little"
    engine = toy.toy_engine(P, Q, K, budget=budget)
    counts = empirical(engine, SAMPLES, seed=77, prompt=[0, 1], temperature=0.7, top_p=0.9)
    law = toy.exact_continuations(P2, Q2, first=1, n=N_TOKENS, k=K, budget=budget)
    assert chi_square_p(counts, law) > ALPHA
    raw = toy.exact_continuations(P, Q, first=1, n=N_TOKENS, k=K, budget=budget)
    assert chi_square_p(counts, raw) < ALPHA


def record_sources(engine) -> list[set[str]]:
    """Wrap the controller's propose: for each round, the set of sources that drafted."""
    spec, rounds = engine.spec, []
    propose = spec.propose

    def recording(plan):
        rounds.append({spec.state(s).source for s, k in zip(plan.decode, plan.ks) if k})
        return propose(plan)

    spec.propose = recording
    return rounds


def test_suffix_drafts_with_the_shared_cache_keep_the_target_law():
    """Suffix drafts (one-hot, from this request and from earlier outputs) are lossless."""
    P = toy.random_table(VOCAB, seed=3)
    engine = toy.toy_engine(P, None, 3, method="suffix")
    engine.add_request([0, 1, 2, 0, 1], SamplingParams(n=64, temperature=1.0, max_tokens=12,
                                                       ignore_eos=True, seed=5))
    toy.run_all(engine)  # earlier outputs for the shared cache
    assert engine.spec.lookup.cache.num_tokens > 0
    counts = empirical(engine, SAMPLES, seed=99, prompt=[0, 1, 2, 0, 1])
    law = toy.exact_continuations(P, P, first=1, n=N_TOKENS, k=0, budget=0.0)  # P's chain
    assert chi_square_p(counts, law, min_expected=5) > ALPHA
    assert engine.metrics.total.sources["suffix"][1] > 0, "the suffix drafter never drafted"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_mixed_sources_in_one_pass_keep_the_target_law(temperature):
    """Hybrid with a fixed k: a sequence whose context has an earlier match drafts from the
    suffix source, the others from the draft model, in the same pass; the continuations still
    follow the target's law (at T = 0.7 the law of P sharpened by the temperature)."""
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    engine = toy.toy_engine(P, Q, K, method="hybrid", spec_fields={"suffix_cache_tokens": 0})
    rounds = record_sources(engine)
    params = SamplingParams(n=SAMPLES, temperature=temperature, max_tokens=N_TOKENS,
                            ignore_eos=True, seed=2024)
    engine.add_request([0, 1], params)
    (out,) = toy.run_all(engine)
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    target = toy.tempered(P, temperature)
    law = toy.exact_continuations(target, target, first=1, n=N_TOKENS, k=0, budget=0.0)
    assert chi_square_p(counts, law, min_expected=5) > ALPHA
    assert any(r == {"lookup", "draft_model"} for r in rounds), "no pass mixed the sources"


def test_mixed_sources_chi_square_catches_a_subtly_wrong_verifier(monkeypatch):
    """The can-fail check of the mixed test: a verifier that accepts one-hot drafts a little
    too often (its uniforms scaled by 0.8) must be caught by the same χ² test."""
    from specserve.engine import rounds as engine_module

    verify = engine_module.verify

    def lenient(drafts, draft_probs, target_probs, uniforms, *rest):
        scale = 0.8 if draft_probs is None else 1.0  # only the lookup's (one-hot) drafts
        return verify(drafts, draft_probs, target_probs, uniforms * scale, *rest)

    monkeypatch.setattr(engine_module, "verify", lenient)
    P, Q = toy.random_table(VOCAB, seed=1), toy.random_table(VOCAB, seed=2, concentration=0.3)
    engine = toy.toy_engine(P, Q, K, method="hybrid", spec_fields={"suffix_cache_tokens": 0})
    counts = empirical(engine, SAMPLES, seed=2024, prompt=[0, 1])
    law = toy.exact_continuations(P, P, first=1, n=N_TOKENS, k=0, budget=0.0)
    assert chi_square_p(counts, law, min_expected=5) < ALPHA
