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

The sampler is a pure function: all randomness arrives as uniforms in [0, 1), so tests are
exact and seeded. Arithmetic is float64 (torch float64 on vocabulary rows, Python floats on
the per-draft scalars).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("recovered", "bonus", "none")
CHUNK_ELEMENTS = 1 << 18  # mentored rounds measure TV over about this many row entries at a time


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
    u = _check_uniform(uniform, "uniform")
    if probs.dim() != 1:
        raise ValueError(f"probs must be 1-D [vocab], got shape {tuple(probs.shape)}")
    probs = _f64(probs)  # [vocab]
    if float(probs.min()) < 0:
        raise ValueError("probs must be non-negative")
    index = _inverse_cdf(probs, u)
    if index is None:
        raise ValueError("probs must have a positive, finite total")
    return index


# ---------------------------------------------------------------- verification

def verify_greedy(draft_tokens: Tensor, target_probs_or_logits: Tensor,
                  bonus_token: bool = True) -> VerifyResult:
    """Greedy verification: accept while argmax p_i == x_i, then emit argmax p_i.

    Ties go to the lowest index (torch.argmax). No budget is spent: tv_distances are zeros.
    With k = 0 the argmax of row 0 is emitted whatever `bonus_token` says.
    """
    drafts = _check_round(draft_tokens, target_probs_or_logits)
    k = len(drafts)
    best = target_probs_or_logits.argmax(-1).tolist()  # [k + 1]
    num_accepted = next((i for i, x in enumerate(drafts) if best[i] != x), k)
    if num_accepted < k:
        return VerifyResult(drafts[:num_accepted] + [best[num_accepted]], num_accepted,
                            "recovered", [0.0] * (num_accepted + 1))
    if bonus_token or k == 0:
        return VerifyResult(drafts + [best[k]], k, "bonus", [0.0] * k)
    return VerifyResult(drafts, k, "none", [0.0] * k)


def verify(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
           uniforms: Tensor | list[float], residual_uniform: float, tv_budget: float = 0.0,
           bonus_token: bool = True) -> VerifyResult:
    """Verify one round of k draft tokens against k + 1 target distributions.

    draft_tokens: [k] integer; draft_probs: [k, vocab] or None (one-hot drafts);
    target_probs: [k + 1, vocab]; uniforms: [k] accept draws in [0, 1);
    residual_uniform: the draw in [0, 1) for the recovered or bonus token.
    Draft i is accepted when uniforms[i] < a_i(x_i). With k = 0 the round is a plain decode
    step: one token sampled from target_probs[0] whatever `bonus_token` says.
    """
    _check_tv_budget(tv_budget)
    drafts = _check_round(draft_tokens, target_probs)
    k = len(drafts)
    _check_draft_probs(draft_probs, target_probs, k)
    us = _check_uniforms(uniforms, k)
    residual_u = _check_uniform(residual_uniform, "residual_uniform")

    num_accepted, tv = _count_accepted(draft_tokens, draft_probs, target_probs, us, tv_budget)
    if num_accepted < k:
        q = _draft_row(draft_probs, drafts, num_accepted, target_probs.shape[1])  # [vocab]
        token = _sample_recovered(target_probs[num_accepted], q, residual_u)
        return VerifyResult(drafts[:num_accepted] + [token], num_accepted, "recovered", tv)
    if bonus_token or k == 0:
        return VerifyResult(drafts + [sample_from(target_probs[k], residual_u)], k, "bonus", tv)
    return VerifyResult(drafts, k, "none", tv)


def _count_accepted(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                    us: list[float], tv_budget: float) -> tuple[int, list[float]]:
    """Drafts kept before the first rejection, and TV(pi_i, p_i) = theta_i d_i per verified draft.

    Lossless rounds (D = 0) only gather p_i(x_i) and q_i(x_i). Mentored rounds need d_i over
    the vocabulary; they measure it a chunk of rows at a time and stop at the first rejection.
    """
    k = draft_tokens.numel()
    long_tokens = draft_tokens if draft_tokens.dtype == torch.long else draft_tokens.long()
    index = long_tokens.unsqueeze(1)  # [k, 1]
    p_x = _column(target_probs.gather(1, index))  # [k] p_i(x_i); gather reads rows 0..k-1
    q_x = [1.0] * k if draft_probs is None else _column(draft_probs.gather(1, index))  # [k]
    chunk = max(1, CHUNK_ELEMENTS // target_probs.shape[1])
    tv: list[float] = []
    for start in range(0, k, chunk):
        stop = min(k, start + chunk)
        ds = _draft_tvs(target_probs, draft_probs, p_x, start, stop) if tv_budget > 0 else None
        for i in range(start, stop):
            theta = 0.0 if ds is None else _mentor_weight(ds[i - start], tv_budget)
            tv.append(0.0 if ds is None else theta * ds[i - start])
            if us[i] >= _accept_prob(_mix(p_x[i], q_x[i], theta), q_x[i]):
                return i, tv
    return k, tv


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
    """First index whose cumulative mass exceeds u * total; None if the total is not positive."""
    cdf = probs.cumsum(0)  # [vocab]
    total = float(cdf[-1])
    if not 0.0 < total < math.inf:
        return None
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index == probs.numel():  # u * total rounded up to the total
        index = int(probs.nonzero()[-1])
    return index


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


# ---------------------------------------------------------------- validation

def _check_tv_budget(tv_budget: float) -> None:
    if not 0.0 <= tv_budget <= 1.0:  # also rejects NaN
        raise ValueError(f"tv_budget must be in [0, 1], got {tv_budget}")


def _check_uniform(uniform: float | Tensor, name: str) -> float:
    u = float(uniform)
    if not 0.0 <= u < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {u}")
    return u


def _check_uniforms(uniforms: Tensor | list[float], k: int) -> list[float]:
    us = uniforms.tolist() if isinstance(uniforms, Tensor) else list(uniforms)
    if not isinstance(us, list) or len(us) != k:
        raise ValueError(f"uniforms must hold k = {k} draws, got {len(us)}")
    if not all(0.0 <= u < 1.0 for u in us):
        raise ValueError(f"uniforms must lie in [0, 1), got {us}")
    return us


def _check_round(draft_tokens: Tensor, target_probs: Tensor) -> list[int]:
    """Validate a round's shapes; the draft tokens as a list."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [k], got shape {tuple(draft_tokens.shape)}")
    if not _is_integer(draft_tokens):
        raise ValueError(f"draft_tokens must be integer, got {draft_tokens.dtype}")
    drafts = draft_tokens.tolist()
    k = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have shape [k + 1, vocab] = [{k + 1}, vocab], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if not all(0 <= x < vocab for x in drafts):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {drafts}")
    return drafts


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_draft_probs(draft_probs: Tensor | None, target_probs: Tensor, k: int) -> None:
    if draft_probs is None:
        return
    expected = (k, target_probs.shape[1])
    if tuple(draft_probs.shape) != expected:
        raise ValueError(f"draft_probs must have shape {list(expected)}, "
                         f"got {tuple(draft_probs.shape)}")
