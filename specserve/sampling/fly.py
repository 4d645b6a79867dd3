"""FLy-style verification: defer a rejection where the target hesitates and the drafts that
follow still agree with it. Lossy by design; off unless a request asks for it.

After Li et al., "Training-Free Loosely Speculative Decoding: Accepting Semantically Correct
Drafts Beyond Exact Match" (arXiv:2511.22972), written here from its description. The
native rule is the one of `sampling/rejection.py` (lossless, or mentored with budgets D_i):
it judges every draft x_i, each in the context of the drafts before it, with the uniform
u_i, giving a verdict n_i in {accept, reject}. FLy walks the drafts in order; at position i

- n_i = accept: x_i is **accepted**;
- n_i = reject, and all of
    (gate)   h_k(g_i) >= tau, with h_k the normalized top-k entropy of `sampling/entropy.py`
             and g_i the gate distribution (the processed p_i, or the raw softmax when greedy),
    (token)  x_i is one of g_i's k most likely tokens and g_i(x_i) > 0,
    (window) i + W < k and n_{i+1} = ... = n_{i+W} = accept:
  x_i is **deferred**: kept as if accepted (the target's next W verdicts, given x_i, agree
  with the draft, which reads as a paraphrase rather than an error);
- otherwise the round stops: x_i is rejected and the **recovered** token is sampled from
  normalize(max(p_i - q_i, 0)) with the residual uniform, as in the native rule.

If the walk passes all k drafts the **bonus** token comes from p_k. A later rejection may
be deferred again once past the window. FLy never rejects a draft the native rule accepts,
so it accepts at least as many drafts for the same uniforms; with no position able to
defer (W >= k, tau above every h_k, or no draft among the top-k) it is the native rule
exactly, and with the lossless native rule the lossless law.

Reported TV per verified position: the native rule's theta_i d_i where it decided (0 when
lossless); at a deferral the token is forced, a one-hot at x_i, and 1 - p_i(x_i) =
TV(one-hot(x_i), p_i) is reported, so FLy's mean TV counts what its deferrals override.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sampling.entropy import normalized_topk_entropy
from specserve.sampling.params import SamplingParams, check_fly
from specserve.sampling.rejection import VerifyResult, native_decisions, reject_at, sample_from
from specserve.sampling.round_checks import check_verify_args


@dataclass(frozen=True, slots=True)
class FlySettings:
    """W = `window` later verdicts that must agree (>= 1), the entropy threshold tau in [0, 1]
    and the k of the top-k entropy (>= 2)."""

    window: int
    entropy_threshold: float = 0.3
    top_k: int = 3

    def __post_init__(self) -> None:
        checked = check_fly("fly", self.window, self.entropy_threshold, self.top_k)
        for name, value in zip(("window", "entropy_threshold", "top_k"), checked):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, params: SamplingParams) -> "FlySettings | None":
        """A request's FLy settings, or None when it does not ask for FLy."""
        if params.fly_window is None:
            return None
        return cls(params.fly_window, params.fly_entropy_threshold, params.fly_top_k)


def gate_open(draft_tokens: Tensor, gate_probs: Tensor, settings: FlySettings) -> list[bool]:
    """Per draft: the (gate) and (token) conditions hold. draft_tokens [k]; gate_probs [>= k, vocab]."""
    k = draft_tokens.numel()
    if k == 0:
        return []
    rows = gate_probs[:k]  # [k, vocab]
    h = normalized_topk_entropy(rows, settings.top_k).tolist()  # [k]
    m = min(settings.top_k, rows.shape[1])
    top = rows.topk(m, dim=-1).indices  # [k, m]
    index = draft_tokens.long().unsqueeze(1)  # [k, 1]
    among = (top == index).any(-1).tolist()  # [k]
    g_x = rows.gather(1, index).squeeze(1).tolist()  # [k] g_i(x_i)
    return [h[i] >= settings.entropy_threshold and among[i] and g_x[i] > 0 for i in range(k)]


def verify_fly(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
               uniforms: Tensor | list[float], residual_uniform: float, settings: FlySettings,
               gate_probs: Tensor | None = None, tv_budget: float | Sequence[float] = 0.0,
               bonus_token: bool = True) -> VerifyResult:
    """Verify one round with FLy on top of the native rule (see the module docstring).

    Arguments as `rejection.verify`, plus `settings` and `gate_probs` ([k + 1, vocab] or
    [k, vocab]; None: target_probs), whose top-k entropy the gate reads.
    """
    drafts, budgets, us, residual_u = check_verify_args(draft_tokens, draft_probs, target_probs,
                                                        uniforms, residual_uniform, tv_budget)
    k = len(drafts)
    gate_probs = target_probs if gate_probs is None else gate_probs
    if gate_probs.dim() != 2 or gate_probs.shape[0] < k or gate_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(f"gate_probs must have shape [k (+ 1), vocab] = [{k}, "
                         f"{target_probs.shape[1]}], got {tuple(gate_probs.shape)}")

    native, tv = native_decisions(draft_tokens, draft_probs, target_probs, us, budgets,
                                  until_rejection=False)
    num_kept, deferred = _walk(native, gate_open(draft_tokens, gate_probs, settings), settings.window)
    tv = tv[:num_kept + (num_kept < k)]
    for i in deferred:
        tv[i] = 1.0 - float(target_probs[i, drafts[i]].to(torch.float64))
    if num_kept < k:
        return reject_at(num_kept, drafts, draft_probs, target_probs, residual_u, tv)
    if bonus_token or k == 0:
        return VerifyResult(drafts + [sample_from(target_probs[k], residual_u)], k, "bonus", tv)
    return VerifyResult(drafts, k, "none", tv)


def _walk(native: list[bool], gate: list[bool], window: int) -> tuple[int, list[int]]:
    """Drafts kept before the round stops, and the positions kept by deferral.

    E.g. native [T, F, T, T, F], gate [., T, ., ., T], W = 2: position 1 defers (2 and 3
    agree), position 4 has no room for a window and stops the round: (4, [1]).
    """
    k = len(native)
    deferred = []
    for i in range(k):
        if native[i]:
            continue
        if gate[i] and i + window < k and all(native[i + 1:i + window + 1]):
            deferred.append(i)
            continue
        return i, deferred
    return k, deferred
