"""Rejection sampler: verify one speculative round of one sequence, lossless or mentored.

Vocabulary (SPEC §3). The draft proposes k tokens x_0..x_{k-1}; the target scores k + 1
positions in one pass, giving `target_probs` p_0..p_k. `draft_probs` q_0..q_{k-1} are the
distributions the draft tokens were sampled from (None for deterministic drafters such as
prompt lookup or greedy drafts: q_i is then one-hot at x_i, so one algorithm serves all).
Each emitted token is
- **accepted**: a draft token kept;
- **recovered**: sampled after the first rejection, from normalize(max(p_i - q_i, 0));
- **bonus**: sampled from p_k when all k draft tokens were accepted.

Lossless rule (Leviathan et al., arXiv:2211.17192; Chen et al., arXiv:2302.01318): accept x_i
with probability min(1, p_i(x_i) / q_i(x_i)). The emitted token at every position is then
distributed exactly as p_i.

Mentored decoding with a total-variation budget D in [0, 1]: with d = TV(p, q) = 1/2 sum|p - q|,
theta = 1 if d <= D else D / d, and pi = (1 - theta) p + theta q, accept with
min(1, pi(x) / q(x)) and recover from normalize(max(p - q, 0)), which equals
normalize(max(pi - q, 0)). The emitted token is distributed exactly as pi, TV(pi, p) =
theta d <= D, and the acceptance probability is 1 - max(0, d - D), the most any distribution
within TV D of p can reach. D = 0 is the lossless rule; the bonus token always comes from p.

The sampler is a pure function: all randomness arrives as uniforms in [0, 1), so tests are
exact and seeded. Everything is computed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("recovered", "bonus", "none")


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
    tv_distances: list[float]  # [num_accepted + (kind == "recovered")] TV(pi_i, p_i) per verified draft

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
            raise ValueError(f"tv_distances has {len(self.tv_distances)} entries; expected {verified}")


# ---------------------------------------------------------------- distribution helpers

def tv_distance(p: Tensor, q: Tensor) -> float:
    """Total-variation distance 1/2 sum|p - q| between two distributions over one vocabulary."""
    return float(_tv_rows(_f64(p), _f64(q)))


def mentored_distribution(p: Tensor, q: Tensor, tv_budget: float) -> Tensor:
    """pi = (1 - theta) p + theta q, the distribution a mentored step emits (float64, [vocab])."""
    _check_tv_budget(tv_budget)
    p, q = _f64(p), _f64(q)
    theta = _mentor_weight(_tv_rows(p, q), tv_budget)
    return _mix(p, q, theta)


def per_token_acceptance(p: Tensor, q: Tensor, tv_budget: float = 0.0) -> Tensor:
    """a(x) = min(1, pi(x) / q(x)) for every token x (float64, [vocab]).

    A token the draft gave zero probability cannot have been sampled from q; should it be
    proposed anyway it is accepted if pi gives it mass and rejected otherwise.
    """
    p, q = _f64(p), _f64(q)
    return _accept_prob(mentored_distribution(p, q, tv_budget), q)


def acceptance_probability(p: Tensor, q: Tensor, tv_budget: float = 0.0) -> float:
    """Probability that a draft token x ~ q is accepted: 1 - max(0, TV(p, q) - D)."""
    _check_tv_budget(tv_budget)
    return 1.0 - max(0.0, tv_distance(p, q) - tv_budget)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p - q, 0)) along the last axis; p normalized where that mass is 0 (p == q)."""
    p, q = _f64(p), _f64(q)
    residual = (p - q).clamp_min_(0.0)  # [..., vocab]
    mass = residual.sum(-1, keepdim=True)  # [..., 1]
    fallback = p / p.sum(-1, keepdim=True)  # [..., vocab]
    return torch.where(mass > 0, residual / mass.clamp_min(1e-300), fallback)


def sample_from(probs: Tensor, uniform: float | Tensor) -> int:
    """Inverse-CDF sample: the smallest index whose float64 cumulative mass exceeds uniform * total.

    The comparison is strict, so an index with zero probability is never chosen: its cumulative
    mass equals its predecessor's, which would have been chosen first.
    """
    u = _check_uniform(uniform, "uniform")
    if probs.dim() != 1:
        raise ValueError(f"probs must be 1-D [vocab], got shape {tuple(probs.shape)}")
    probs = _f64(probs)  # [vocab]
    if bool((probs < 0).any()):
        raise ValueError("probs must be non-negative")
    cdf = probs.cumsum(0)  # [vocab]
    total = float(cdf[-1])
    if not total > 0 or not math.isfinite(total):
        raise ValueError(f"probs must have a positive finite total, got {total}")
    threshold = torch.tensor([u * total], dtype=torch.float64)  # [1]
    index = int(torch.searchsorted(cdf, threshold, right=True))
    if index == probs.numel():  # u * total rounded up to the total
        index = int(probs.nonzero()[-1])
    return index


# ---------------------------------------------------------------- verification

def verify_greedy(draft_tokens: Tensor, target_probs_or_logits: Tensor,
                  bonus_token: bool = True) -> VerifyResult:
    """Greedy verification: accept while argmax p_i == x_i, then emit argmax p_i.

    Ties go to the lowest index (torch.argmax). No budget is spent: tv_distances are zeros.
    """
    k = _check_round(draft_tokens, target_probs_or_logits)
    best = target_probs_or_logits.argmax(-1)  # [k + 1]
    mismatch = (best[:k] != draft_tokens).nonzero()  # [num_mismatches, 1]
    num_accepted = int(mismatch[0]) if mismatch.numel() else k
    tokens = draft_tokens[:num_accepted].tolist()
    if num_accepted < k:
        return VerifyResult(tokens + [int(best[num_accepted])], num_accepted, "recovered",
                            [0.0] * (num_accepted + 1))
    if bonus_token or k == 0:
        return VerifyResult(tokens + [int(best[k])], k, "bonus", [0.0] * k)
    return VerifyResult(tokens, k, "none", [0.0] * k)


def verify(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
           uniforms: Tensor, residual_uniform: float, tv_budget: float = 0.0,
           bonus_token: bool = True) -> VerifyResult:
    """Verify one round of k draft tokens against k + 1 target distributions.

    draft_tokens: [k] long; draft_probs: [k, vocab] or None (one-hot drafts);
    target_probs: [k + 1, vocab]; uniforms: [k] accept draws in [0, 1);
    residual_uniform: the draw in [0, 1) for the recovered or bonus token.
    Draft i is accepted when uniforms[i] < a_i(x_i). With k = 0 the round is a plain decode
    step: one token sampled from target_probs[0], whatever `bonus_token` says.
    """
    _check_tv_budget(tv_budget)
    k = _check_round(draft_tokens, target_probs)
    _check_draft_probs(draft_probs, target_probs, k)
    uniforms = torch.as_tensor(uniforms, dtype=torch.float64)  # [k]
    if uniforms.shape != (k,):
        raise ValueError(f"uniforms must have shape ({k},), got {tuple(uniforms.shape)}")
    if bool(((uniforms < 0) | (uniforms >= 1)).any()):
        raise ValueError("uniforms must lie in [0, 1)")
    residual_uniform = _check_uniform(residual_uniform, "residual_uniform")

    accept, tv = _accept_probs_at_drafts(draft_tokens, draft_probs, target_probs, tv_budget)
    rejected = (uniforms >= accept).nonzero()  # [num_rejected, 1]
    num_accepted = int(rejected[0]) if rejected.numel() else k
    tokens = draft_tokens[:num_accepted].tolist()
    if num_accepted < k:
        q = _draft_row(draft_probs, draft_tokens, num_accepted, target_probs.shape[-1])  # [vocab]
        residual = residual_distribution(target_probs[num_accepted], q)  # [vocab]
        token = sample_from(residual, residual_uniform)
        return VerifyResult(tokens + [token], num_accepted, "recovered", tv[:num_accepted + 1])
    if bonus_token or k == 0:
        token = sample_from(target_probs[k], residual_uniform)
        return VerifyResult(tokens + [token], k, "bonus", tv)
    return VerifyResult(tokens, k, "none", tv)


def _accept_probs_at_drafts(draft_tokens: Tensor, draft_probs: Tensor | None,
                            target_probs: Tensor, tv_budget: float) -> tuple[Tensor, list[float]]:
    """Acceptance probability a_i(x_i) ([k]) and realised TV(pi_i, p_i) = theta_i d_i per draft.

    Lossless rounds (D = 0) need only the gathered probabilities, never a full vocabulary row.
    """
    k = draft_tokens.numel()
    index = draft_tokens.long().unsqueeze(-1)  # [k, 1]
    p_x = _f64(target_probs[:k].gather(-1, index)).squeeze(-1)  # [k]
    if draft_probs is None:
        q_x = torch.ones(k, dtype=torch.float64)  # [k]
    else:
        q_x = _f64(draft_probs.gather(-1, index)).squeeze(-1)  # [k]
    if tv_budget == 0.0:
        return _accept_prob(p_x, q_x), [0.0] * k
    p = _f64(target_probs[:k])  # [k, vocab]
    q = _draft_rows(draft_probs, index, p)  # [k, vocab]
    d = _tv_rows(p, q)  # [k]
    theta = _mentor_weight(d, tv_budget)  # [k]
    accept = _accept_prob(_mix(p_x, q_x, theta), q_x)  # [k]
    return accept, (theta * d).tolist()


# ---------------------------------------------------------------- shared math

def _tv_rows(p: Tensor, q: Tensor) -> Tensor:
    return 0.5 * torch.sub(p, q).abs_().sum(-1)  # [...]


def _mentor_weight(d: Tensor, tv_budget: float) -> Tensor:
    """theta = 1 where d <= D (including d = 0), else D / d; D = 1 always gives 1."""
    if tv_budget >= 1.0:
        return torch.ones_like(d)
    return torch.where(d > tv_budget, tv_budget / d, torch.ones_like(d))  # [...]


def _mix(p: Tensor, q: Tensor, theta: Tensor) -> Tensor:
    """(1 - theta) p + theta q; theta has p's shape without its last axis, or p's shape."""
    if theta.dim() < p.dim():
        theta = theta.unsqueeze(-1)
    return (1.0 - theta) * p + theta * q  # theta = 1 gives q exactly


def _accept_prob(pi: Tensor, q: Tensor) -> Tensor:
    ratio = torch.where(q > 0, pi / q, (pi > 0).to(pi.dtype))
    return ratio.clamp_(max=1.0)


def _draft_rows(draft_probs: Tensor | None, index: Tensor, like: Tensor) -> Tensor:
    if draft_probs is None:
        return torch.zeros_like(like).scatter_(-1, index, 1.0)  # [k, vocab] one-hot
    return _f64(draft_probs)  # [k, vocab]


def _draft_row(draft_probs: Tensor | None, draft_tokens: Tensor, i: int, vocab: int) -> Tensor:
    if draft_probs is None:
        row = torch.zeros(vocab, dtype=torch.float64)  # [vocab]
        row[int(draft_tokens[i])] = 1.0
        return row
    return _f64(draft_probs[i])  # [vocab]


def _f64(t: Tensor) -> Tensor:
    return t.to(torch.float64)


# ---------------------------------------------------------------- validation

def _check_tv_budget(tv_budget: float) -> None:
    if not 0.0 <= tv_budget <= 1.0:  # also rejects NaN
        raise ValueError(f"tv_budget must be in [0, 1], got {tv_budget}")


def _check_uniform(uniform: float | Tensor, name: str) -> float:
    u = float(uniform)
    if not 0.0 <= u < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {u}")
    return u


def _check_round(draft_tokens: Tensor, target_probs: Tensor) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [k], got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex():
        raise ValueError(f"draft_tokens must be integer, got {draft_tokens.dtype}")
    k = draft_tokens.numel()
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have shape [k + 1, vocab] = [{k + 1}, vocab], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if k and bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
        raise ValueError(f"draft_tokens must lie in [0, {vocab})")
    return k


def _check_draft_probs(draft_probs: Tensor | None, target_probs: Tensor, k: int) -> None:
    if draft_probs is None:
        return
    expected = (k, target_probs.shape[1])
    if tuple(draft_probs.shape) != expected:
        raise ValueError(f"draft_probs must have shape {list(expected)}, got {tuple(draft_probs.shape)}")
