"""Rejection sampler: verify one speculative round of one sequence, lossless or mentored.

Vocabulary. The draft proposes k tokens x_0..x_{k-1}; the target scores k + 1
positions in one pass, giving `target_probs` p_0..p_k. `draft_probs` q_0..q_{k-1} are the
distributions the draft tokens were sampled from; deterministic drafters (prompt lookup,
greedy drafts) pass None and q_i is one-hot at x_i, so one algorithm serves all. Each emitted
token is
- **accepted**: a draft token kept;
- **recovered**: sampled after the first rejection, from normalize(max(p_i - q_i, 0));
- **bonus**: sampled from p_k when all k draft tokens were accepted.

Lossless rule (Leviathan et al., arXiv:2211.17192; Chen et al., arXiv:2302.01318): accept x_i
with probability min(1, p_i(x_i) / q_i(x_i)); every emitted token is then distributed exactly
as p_i.

Mentored decoding with a total-variation budget D in [0, 1]: with d = TV(p, q) = 1/2 sum|p - q|,
theta = 1 if d <= D else D / d, and pi = (1 - theta) p + theta q, accept with
min(1, pi(x) / q(x)) and recover from normalize(max(p - q, 0)), which equals
normalize(max(pi - q, 0)). The emitted token is distributed exactly as pi, TV(pi, p) =
theta d <= D, and the acceptance probability is 1 - max(0, d - D), the most any distribution
within TV D of p can reach. D = 0 is the lossless rule; the bonus token always comes from p.
The budget may also be given per draft position, D_0..D_{k-1} (see `sampling/entropy.py` for
a budget shaped by the target's uncertainty); each position then spends its own D_i.

The sampler is a pure function: all randomness arrives as uniforms in [0, 1), so tests are
exact and seeded. Arithmetic is float64 (torch float64 on vocabulary rows, Python floats on
the per-draft scalars).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sampling.processors import argmax_rows
from specserve.sampling.round_checks import check_round, check_uniform, check_verify_args

KINDS = ("recovered", "bonus", "none")
CHUNK_ELEMENTS = 1 << 18  # mentored rounds measure TV over about this many row entries at a time
CDF_BLOCK = 1024  # entries per block of the two-level inverse CDF (`_inverse_cdf`)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of one verified round.

    `kind` names the last token: "recovered" (after a rejection), "bonus" (all drafts accepted,
    sampled from the target's last position; also the plain sample of a k = 0 round) or "none"
    (all drafts accepted and the bonus token disabled).
    """

    tokens: list[int]  # [num_accepted + (kind != "none")]
    num_accepted: int
    kind: str
    tv_distances: list[float]  # [num_accepted + (kind == "recovered")] TV(pi_i, p_i) per draft

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.num_accepted < 0:
            raise ValueError(f"num_accepted must be >= 0, got {self.num_accepted}")
        extra = self.kind != "none"
        if len(self.tokens) != self.num_accepted + extra:
            raise ValueError(f"tokens has {len(self.tokens)} entries; expected num_accepted "
                             f"({self.num_accepted}) + {int(extra)} for kind {self.kind!r}")
        verified = self.num_accepted + (self.kind == "recovered")
        if len(self.tv_distances) != verified:
            raise ValueError(f"tv_distances has {len(self.tv_distances)} entries; "
                             f"expected {verified}")


def sample_from(probs: Tensor, uniform: float | Tensor) -> int:
    """Inverse-CDF sample: the smallest index whose float64 cumulative mass exceeds uniform * total.

    The comparison is strict, so an index of zero probability is never chosen: its cumulative
    mass equals its predecessor's, which would have been chosen first. `probs` need not sum to 1.
    """
    u = check_uniform(uniform, "uniform")
    if probs.dim() != 1:
        raise ValueError(f"probs must be 1-D [vocab], got shape {tuple(probs.shape)}")
    if float(probs.min()) < 0:
        raise ValueError("probs must be non-negative")
    index = _inverse_cdf(probs, u)  # sums in float64 whatever the dtype of `probs`
    if index is None:
        raise ValueError("probs must have a positive, finite total")
    return index


# ---------------------------------------------------------------- verification

def verify_greedy(draft_tokens: Tensor, target_probs_or_logits: Tensor,
                  bonus_token: bool = True) -> VerifyResult:
    """Greedy verification: accept while argmax p_i == x_i, then emit argmax p_i.

    Ties go to the lowest index (as torch.argmax: `argmax_rows`). No budget is spent:
    tv_distances are zeros. With k = 0 the argmax of row 0 is emitted whatever `bonus_token`
    says.
    """
    drafts = check_round(draft_tokens, target_probs_or_logits)
    k = len(drafts)
    best = argmax_rows(target_probs_or_logits)  # [k + 1]
    num_accepted = next((i for i, x in enumerate(drafts) if best[i] != x), k)
    if num_accepted < k:
        return VerifyResult(drafts[:num_accepted] + [best[num_accepted]], num_accepted,
                            "recovered", [0.0] * (num_accepted + 1))
    if bonus_token or k == 0:
        return VerifyResult(drafts + [best[k]], k, "bonus", [0.0] * k)
    return VerifyResult(drafts, k, "none", [0.0] * k)


def verify(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
           uniforms: Tensor | list[float], residual_uniform: float,
           tv_budget: float | Sequence[float] = 0.0, bonus_token: bool = True) -> VerifyResult:
    """Verify one round of k draft tokens against k + 1 target distributions.

    draft_tokens: [k] integer; draft_probs: [k, vocab] or None (one-hot drafts);
    target_probs: [k + 1, vocab]; uniforms: [k] accept draws in [0, 1);
    residual_uniform: the draw in [0, 1) for the recovered or bonus token;
    tv_budget: one D for every position, or [k] budgets D_i.
    Draft i is accepted when uniforms[i] < a_i(x_i). With k = 0 the round is a plain decode
    step: one token sampled from target_probs[0] whatever `bonus_token` says.
    """
    drafts, budgets, us, residual_u = check_verify_args(draft_tokens, draft_probs, target_probs,
                                                        uniforms, residual_uniform, tv_budget)
    k = len(drafts)

    decisions, tv = native_decisions(draft_tokens, draft_probs, target_probs, us, budgets)
    num_accepted = decisions.index(False) if False in decisions else k
    if num_accepted < k:
        return reject_at(num_accepted, drafts, draft_probs, target_probs, residual_u, tv)
    if bonus_token or k == 0:
        return VerifyResult(drafts + [sample_from(target_probs[k], residual_u)], k, "bonus", tv)
    return VerifyResult(drafts, k, "none", tv)


def reject_at(i: int, drafts: list[int], draft_probs: Tensor | None, target_probs: Tensor,
              residual_u: float, tv: list[float]) -> VerifyResult:
    """The round that keeps drafts[:i] and recovers position i from normalize(max(p_i - q_i, 0))."""
    q = _draft_row(draft_probs, drafts, i, target_probs.shape[1])  # [vocab]
    token = _sample_recovered(target_probs[i], q, residual_u)
    return VerifyResult(drafts[:i] + [token], i, "recovered", tv)


def native_decisions(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                     us: list[float], budgets: list[float], until_rejection: bool = True
                     ) -> tuple[list[bool], list[float]]:
    """The rule's verdict on each draft (uniforms[i] < a_i(x_i)) and TV(pi_i, p_i) = theta_i d_i.

    With `until_rejection` the lists stop at the first rejection (included); otherwise every
    one of the k drafts is judged, each as if the drafts before it had been kept (the target
    scored them in that context). Lossless positions (D_i = 0) only gather p_i(x_i) and
    q_i(x_i); mentored ones need d_i over the vocabulary, measured a chunk of rows at a time.
    """
    k = draft_tokens.numel()
    long_tokens = draft_tokens if draft_tokens.dtype == torch.long else draft_tokens.long()
    index = long_tokens.unsqueeze(1)  # [k, 1]
    p_x = _column(target_probs.gather(1, index))  # [k] p_i(x_i); gather reads rows 0..k-1
    q_x = [1.0] * k if draft_probs is None else _column(draft_probs.gather(1, index))  # [k]
    chunk = max(1, CHUNK_ELEMENTS // target_probs.shape[1])
    decisions: list[bool] = []
    tv: list[float] = []
    for start in range(0, k, chunk):
        stop = min(k, start + chunk)
        mentored = any(b > 0 for b in budgets[start:stop])
        ds = _draft_tvs(target_probs, draft_probs, p_x, start, stop) if mentored else None
        for i in range(start, stop):
            d = 0.0 if ds is None else ds[i - start]
            theta = _mentor_weight(d, budgets[i]) if budgets[i] > 0 else 0.0
            tv.append(theta * d)
            decisions.append(us[i] < _accept_prob(_mix(p_x[i], q_x[i], theta), q_x[i]))
            if until_rejection and not decisions[-1]:
                return decisions, tv
    return decisions, tv


def _draft_tvs(target_probs: Tensor, draft_probs: Tensor | None, p_x: list[float],
               start: int, stop: int) -> list[float]:
    """TV(p_i, q_i) for positions start..stop-1; a one-hot q_i needs only sum(p_i) and p_i(x_i)."""
    rows = target_probs[start:stop]  # [n, vocab]
    if draft_probs is not None:
        return _tv_rows(_f64(rows), draft_probs[start:stop]).tolist()
    totals = rows.sum(-1, dtype=torch.float64).tolist()  # [n]
    return [0.5 * (s - p + abs(1.0 - p)) for s, p in zip(totals, p_x[start:stop])]


def _sample_recovered(p: Tensor, q: Tensor, u: float) -> int:
    p = _f64(p)  # [vocab]
    index = _inverse_cdf(_residual_mass(p, q), u)
    return sample_from(p, u) if index is None else index  # no residual mass: p == q


# ---------------------------------------------------------------- shared math

def _tv_rows(p: Tensor, q: Tensor) -> Tensor:
    return 0.5 * torch.sub(p, q).abs_().sum(-1)  # [...]; p is float64, so q is promoted


def _mentor_weight(d: float, tv_budget: float) -> float:
    """theta = 1 where d <= D (including d = 0) or D = 1, else D / d."""
    return 1.0 if d <= tv_budget or tv_budget >= 1.0 else tv_budget / d


def _mix(p: Tensor | float, q: Tensor | float, theta: float) -> Tensor | float:
    return (1.0 - theta) * p + theta * q  # theta = 1 gives q exactly


def _accept_prob(pi_x: float, q_x: float) -> float:
    """min(1, pi(x) / q(x)); a token q gave no mass is kept only if pi gives it some."""
    if q_x > 0:
        return min(1.0, pi_x / q_x)
    return 1.0 if pi_x > 0 else 0.0


def _residual_mass(p: Tensor, q: Tensor) -> Tensor:
    return torch.sub(p, q).clamp_min_(0.0)  # [..., vocab] max(p - q, 0), unnormalized


def _inverse_cdf(probs: Tensor, u: float) -> int | None:
    """First index whose float64 cumulative mass exceeds u * total; None if the total is not
    positive and finite.

    In two levels, so that a sample costs one vectorised pass over the vocabulary rather than
    a sequential float64 cumulative sum of it: the
    masses of blocks of `CDF_BLOCK` entries (float64 sums) find the block, then that block's
    own cumulative sum the index. The law is the one of a single cumulative sum; only the
    order of the float64 additions differs, which moves an index only where u * total falls
    within rounding (~1e-16 of the total) of a boundary. Strict comparisons at both levels
    keep zero-mass blocks and entries unchosen.
    """
    n = probs.numel()
    full = n - n % CDF_BLOCK
    blocks = probs[:full].reshape(-1, CDF_BLOCK).sum(1, dtype=torch.float64)  # [n // B]
    if full < n:
        blocks = torch.cat([blocks, probs[full:].sum(dtype=torch.float64).reshape(1)])
    ends = blocks.cumsum(0)  # [blocks]
    total = float(ends[-1])
    if not 0.0 < total < math.inf:
        return None
    target = u * total
    block = int(torch.searchsorted(ends, target, right=True))
    if block == ends.numel():  # u * total rounded up to the total: the last block with mass
        block = int(blocks.nonzero()[-1])
    start = block * CDF_BLOCK
    part = probs[start:start + CDF_BLOCK]
    before = float(ends[block - 1]) if block else 0.0
    index = int(torch.searchsorted(part.cumsum(0, dtype=torch.float64), target - before,
                                   right=True))
    if index == part.numel():  # the block's own sum rounded below its mass in `ends`
        index = int(part.nonzero()[-1])
    return start + index


def _draft_row(draft_probs: Tensor | None, drafts: list[int], i: int, vocab: int) -> Tensor:
    if draft_probs is not None:
        return draft_probs[i]  # [vocab]
    row = torch.zeros(vocab, dtype=torch.float64)  # [vocab] one-hot at the draft token
    row[drafts[i]] = 1.0
    return row


def _column(t: Tensor) -> list[float]:
    return [row[0] for row in t.tolist()]  # [n, 1] -> n floats


def _f64(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.to(torch.float64)
