"""One sequence's round: the target's k + 1 rows of logits → the tokens the round emits.

Lossless or mentored verification (a flat budget, or one shaped by the target's entropy), FLy
when the request asks, greedy verification at T = 0. Under a grammar every row is first
masked with what the grammar allows at that position (after the drafts before it), so the
verifier compares the drafts with the *constrained* target distribution and the output law
is exactly constrained target-only decoding.
"""

from __future__ import annotations

import torch

from specserve.sampling.entropy import entropy_budgets, gate_distribution
from specserve.sampling.fly import FlySettings, fly_gate_distribution, verify_fly
from specserve.sampling.processors import greedy_scores, processed_probs
from specserve.sampling.rejection import VerifyResult, verify, verify_greedy
from specserve.speculative.drafter import Proposal


def truncate_to_grammar(seq, prop: Proposal) -> Proposal:
    """The proposal up to its first draft the sequence's grammar forbids (which the constrained
    target gives probability 0, so it would be rejected for certain: verifying the legal
    prefix, whose last row then gives the bonus, emits the same law)."""
    if seq.grammar is None or not prop.tokens:
        return prop
    legal = seq.grammar.legal_prefix(prop.tokens)
    if legal == prop.k:
        return prop
    probs = prop.draft_probs[:legal] if prop.draft_probs is not None else None
    return Proposal(prop.tokens[:legal], probs)


def constrain(seq, prop: Proposal, logits: torch.Tensor) -> torch.Tensor:
    """`logits` [k + 1, vocab] with what the grammar forbids at each row set to -inf."""
    if seq.grammar is None:
        return logits
    masks, legal = seq.grammar.masks(prop.tokens)  # [k + 1, vocab] bool
    assert legal == prop.k, "drafts are truncated to the grammar before verification"
    rows = masks.shape[0]
    return logits[:rows].masked_fill(~masks, float("-inf"))


def sample_round(seq, prop: Proposal, logits: torch.Tensor, bonus: bool = True
                 ) -> VerifyResult:
    """The round's tokens from the target's `logits` [k + 1, vocab] (row i scored after the
    first i drafts)."""
    logits = constrain(seq, prop, logits)
    drafts = torch.tensor(prop.tokens, dtype=torch.long)  # [k]
    params = seq.params
    fly = FlySettings.of(params) if prop.k >= 2 else None
    if params.greedy and seq.tv_budget == 0.0 and fly is None:
        scores = greedy_scores(logits, params, seq.token_ids, seq.prompt_len, drafts)
        return verify_greedy(drafts, scores, bonus)
    target_probs = processed_probs(logits, params, seq.token_ids, seq.prompt_len,
                                   drafts)  # [k + 1, vocab]
    shaped = params.tv_entropy_top_k is not None and seq.tv_budget > 0 and prop.k > 0
    budget = seq.tv_budget
    if shaped:
        gate = gate_distribution(logits, target_probs, params.greedy)  # [k + 1, vocab]
        budget = entropy_budgets(gate[:prop.k], seq.tv_budget, params.tv_entropy_top_k)
    uniforms = torch.rand(prop.k, generator=seq.generator, dtype=torch.float64)  # [k]
    residual_u = float(torch.rand((), generator=seq.generator, dtype=torch.float64))
    if fly is not None:
        gate = fly_gate_distribution(fly, logits, target_probs, params.greedy)  # [k + 1, vocab]
        return verify_fly(drafts, prop.draft_probs, target_probs, uniforms, residual_u, fly,
                          gate, budget, bonus)
    return verify(drafts, prop.draft_probs, target_probs, uniforms, residual_u, budget, bonus)
