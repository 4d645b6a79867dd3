"""Exact laws of short continuations and the χ² check of samples against them (the
end-to-end distribution tests on tiny real models)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from scipy.stats import chisquare


def enumerate_law(next_law: Callable[[list[int]], dict[int, float]], prompt: list[int],
                  n_tokens: int) -> dict[tuple[int, ...], float]:
    """Every continuation of `n_tokens` tokens after `prompt` with its probability, from
    `next_law(ids)`, the processed distribution of the token after `ids`."""
    law = {(): 1.0}
    for _ in range(n_tokens):
        law = {seq + (t,): p * q for seq, p in law.items()
               for t, q in next_law(prompt + list(seq)).items()}
    assert abs(sum(law.values()) - 1) < 1e-9
    return law


def chi_square_p(counts: Counter, law: dict, min_expected: float = 5,
                 strict: bool = False) -> float:
    """χ² p-value of `counts` against `law`, cells expected fewer than `min_expected` samples
    pooled into one; 0 when a sample falls outside the law (`strict`: an assertion error)."""
    samples = sum(counts.values())
    inside = sum(counts[s] for s in law)
    assert not strict or inside == samples, "a continuation of zero probability came out"
    if inside != samples:
        return 0.0
    cells = sorted(law, key=law.get, reverse=True)
    big = [s for s in cells if law[s] * samples >= min_expected]
    rest = [s for s in cells if law[s] * samples < min_expected]
    observed = [counts[s] for s in big] + ([sum(counts[s] for s in rest)] if rest else [])
    expected = [law[s] * samples for s in big] + ([sum(law[s] for s in rest) * samples]
                                                  if rest else [])
    return chisquare(observed, expected).pvalue


def top_k_law(logits: torch.Tensor, top_k: int, temperature: float) -> dict[int, float]:
    """The processed distribution of one row of logits: divided by the temperature, the top
    `top_k` kept and renormalised (in float64)."""
    top = torch.topk(logits.double(), top_k)
    probs = torch.softmax(top.values / temperature, dim=-1)
    return dict(zip(top.indices.tolist(), probs.tolist()))


def next_token_law(model, ids: list[int], top_k: int, temperature: float) -> dict[int, float]:
    """The processed distribution of the token after `ids`, by a fresh forward pass of `model`
    over the whole of `ids` (a new pool: no caching, no rollback)."""
    from specserve.models.transformer import ForwardBatch

    pool = model.new_pool(1, 16)
    with torch.inference_mode():
        (logits,) = model.forward(ForwardBatch.paged([ids], [0], [[0]], ["law"]), pool,
                                  last_n=[1])
    return top_k_law(logits[-1], top_k, temperature)
