"""The round: propose → cut to the grammar → one target pass → sample (`Round.run`).

`Round.run(plan)` drafts for the step's decoding sequences (the speculation controller's
`propose`), cuts each proposal to what its sequence's grammar allows, runs one ragged target
pass over the verify rows and the prefill chunks (with the final hidden states where a drafter
reads them), and samples every decoding sequence's round and every prompt's first token. It
changes no sequence: it returns one `RoundOutput`, which the engine's update commits.

One sequence's round, `sample_round`: the target's k + 1 rows of logits → the tokens it emits.

Lossless or mentored verification (a flat budget, or one shaped by the target's entropy), FLy
when the request asks, greedy verification at T = 0. Under a grammar every row is first
masked with what the grammar allows at that position (after the drafts before it), so the
verifier compares the drafts with the *constrained* target distribution and the output law
is exactly constrained target-only decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.sampling.entropy import entropy_budgets, gate_distribution
from specserve.sampling.fly import FlySettings, fly_gate_distribution, verify_fly
from specserve.sampling.processors import greedy_scores, processed_probs
from specserve.sampling.grammar import GrammarError
from specserve.sampling.rejection import VerifyResult, verify, verify_greedy
from specserve.speculative.drafter import EMPTY, Proposal


@dataclass(slots=True)
class RoundOutput:
    """What a step's round computed, per decoding sequence (`plan.decode` order) and per
    prefill chunk (`plan.chunks` order); an `errors` entry not None: that sequence's grammar
    cannot go on (its result emits nothing), and the update fails it alone."""

    proposals: list[Proposal]  # the drafts verified, cut to the grammar
    results: list[VerifyResult]  # what each decoding sequence's round emits
    errors: list[Exception | None]
    logits: list[torch.Tensor]  # per decoding sequence, then per chunk (its last row or none)
    firsts: list[VerifyResult | None]  # per chunk: the prompt's first token (None: no sample)
    chunk_errors: list[Exception | None]
    old_lens: list[int]  # each decoding sequence's length before the round
    draft_s: float  # seconds drafting (and cutting to the grammar)
    verify_s: float  # seconds of the target pass and sampling


class Round:
    """The step's round over `runner` (the target's passes) with `spec` (the speculation
    controller, or None: every round is a plain one)."""

    def __init__(self, runner, spec=None) -> None:
        self.runner, self.spec = runner, spec

    def run(self, plan) -> RoundOutput | None:
        """The round of `plan` (a `StepPlan`); None where the target has nothing to run (the
        draft model's prefill chunks alone may still run)."""
        seqs, spec = plan.decode, self.spec
        if not seqs and not plan.chunks:
            if spec is not None:
                spec.propose(plan)
            return None
        bonus = spec.bonus_token if spec is not None else True
        t0 = time.perf_counter()
        proposals = spec.propose(plan) if spec is not None else [EMPTY] * len(seqs)
        proposals = [_legal(s, p) for s, p in zip(seqs, proposals)]
        t1 = time.perf_counter()
        logits = self._forward(plan, proposals)
        results, errors = zip(*(_sample(s, p, lg, bonus)
                                for s, p, lg in zip(seqs, proposals, logits))) if seqs else ((), ())
        t2 = time.perf_counter()
        firsts, chunk_errors = [], []
        for chunk, lg in zip(plan.chunks, logits[len(seqs):]):
            first, error = _sample(chunk.seq, EMPTY, lg, bonus) if chunk.samples else (None, None)
            firsts.append(first)
            chunk_errors.append(error)
        return RoundOutput(proposals, list(results), list(errors), logits, firsts, chunk_errors,
                           [len(s.token_ids) for s in seqs], t1 - t0, t2 - t1)

    def _forward(self, plan, proposals: list[Proposal]) -> list[torch.Tensor]:
        """One target pass: each decoding sequence's last token and drafts, then the prefill
        chunks; the hidden states go to the controller where a drafter reads them."""
        seqs = plan.decode
        rows = [[s.token_ids[-1]] + p.tokens for s, p in zip(seqs, proposals)]
        starts = [s.num_cached for s in seqs]
        tables = [s.table for s in seqs]
        last_n = [len(r) for r in rows]
        prefill = [0] * len(rows)  # decode and verify rows stay off the prefill path
        for c in plan.chunks:
            rows.append(c.seq.token_ids[c.start:c.start + c.num_tokens])
            starts.append(c.start)
            tables.append(c.seq.table)
            last_n.append(1 if c.samples else 0)
            prefill.append(c.prompt_rows)
        spec = self.spec
        if spec is None or not spec.wants_hidden:
            return self.runner.forward(rows, starts, tables, last_n, prefill)
        logits, hidden = self.runner.forward_hidden(rows, starts, tables, last_n, prefill)
        spec.observe_hidden(seqs + [c.seq for c in plan.chunks], starts, hidden)
        return logits


def _legal(seq, prop: Proposal) -> Proposal:
    """The proposal cut to what its grammar allows (a grammar that cannot go on: none; the
    round then fails that sequence alone)."""
    try:
        return truncate_to_grammar(seq, prop)
    except GrammarError:
        return EMPTY


def _sample(seq, prop: Proposal, logits: torch.Tensor, bonus: bool
            ) -> tuple[VerifyResult, Exception | None]:
    try:
        return sample_round(seq, prop, logits, bonus), None
    except GrammarError as error:
        return VerifyResult([], 0, "none", []), error


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
