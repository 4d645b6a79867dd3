"""FLy-style verification: defer a rejection where the target hesitates and the drafts that
follow still agree with it. Lossy by design; off unless a request asks for it.

After Li et al., "Training-Free Loosely Speculative Decoding: Accepting Semantically Correct
Drafts Beyond Exact Match" (arXiv:2511.22972). Two variants, chosen per request:
- "specserve" (ours, `window` = W): written from the paper's description;
- "published": the rule of the authors' code (github AMD-AGI/FLy, `fly/models/FLy.py`), with
  its window count and its gate; its defaults (win_len 6, threshold 0.3, top 3) are ours too.

The native rule is the one of `sampling/rejection.py` (lossless, or mentored with budgets
D_i): it judges every draft x_i, each in the context of the drafts before it, with the
uniform u_i, giving a verdict n_i in {accept, reject}. FLy walks the drafts in order; at
position i

- n_i = accept: x_i is **accepted**;
- n_i = reject, the gate is open at i and the window agrees: x_i is **deferred**, kept as if
  accepted (the target's next verdicts, given x_i, agree with the draft, which reads as a
  paraphrase rather than an error);
- otherwise the round stops: x_i is rejected and the **recovered** token is sampled from
  normalize(max(p_i - q_i, 0)) with the residual uniform, as in the native rule.

The gate and the window, per variant:
- gate distribution g_i: "specserve" reads the processed p_i (the raw softmax when greedy);
  "published" reads the softmax of the raw logits, always;
- gate: "specserve" needs h_k(g_i) >= tau, the normalized top-k entropy of
  `sampling/entropy.py` (tau in [0, 1]), x_i among g_i's k most likely tokens and
  g_i(x_i) > 0; "published" needs H_k(g_i) >= tau, with H_k = -sum g log g over the k
  largest g, unnormalized, in nats (tau in [0, log k]), and nothing of x_i;
- window: "specserve" needs the W verdicts n_{i+1..i+W} to accept and i + W < k;
  "published" counts the rejection in its win_len: n_{i+1..i+win_len-1} accept, and
  i + win_len < k (one more draft after them).

If the walk passes all k drafts the **bonus** token comes from p_k. A later rejection may
be deferred again once past the window. FLy never rejects a draft the native rule accepts,
so it accepts at least as many drafts for the same uniforms; with no position able to
defer (no room for a window, tau above every gate value) it is the native rule exactly, and
with the lossless native rule the lossless law.

Reported TV per verified position: the native rule's theta_i d_i where it decided (0 when
lossless); at a deferral the token is forced, a one-hot at x_i, and 1 - p_i(x_i) =
TV(one-hot(x_i), p_i) is reported, so FLy's mean TV counts what its deferrals override.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sampling.entropy import gate_distribution, normalized_topk_entropy
from specserve.sampling.params import SamplingParams, check_fly
from specserve.sampling.rejection import VerifyResult, native_decisions, reject_at, sample_from
from specserve.sampling.round_checks import check_verify_args


@dataclass(frozen=True, slots=True)
class FlySettings:
    """`window` (W for "specserve", the published win_len for "published"; >= 1), the entropy
    threshold tau (its range per variant: see the module docstring), the k of the top-k gate
    (>= 2) and the variant."""

    window: int
    entropy_threshold: float = 0.3
    top_k: int = 3
    variant: str = "specserve"

    def __post_init__(self) -> None:
        checked = check_fly("fly", self.window, self.entropy_threshold, self.top_k, self.variant)
        for name, value in zip(("window", "entropy_threshold", "top_k", "variant"), checked):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, params: SamplingParams) -> "FlySettings | None":
        """A request's FLy settings, or None when it does not ask for FLy."""
        if params.fly_window is None:
            return None
        return cls(params.fly_window, params.fly_entropy_threshold, params.fly_top_k,
                   params.fly_variant)

    @property
    def published(self) -> bool:
        return self.variant == "published"

    @property
    def agreeing(self) -> int:
        """Native verdicts after a rejection that must accept for it to be deferred."""
        return self.window - 1 if self.published else self.window

    @property
    def room(self) -> int:
        """Drafts that must follow a deferrable rejection: i + room < k."""
        return self.window


def fly_gate_distribution(settings: FlySettings, logits: Tensor, target_probs: Tensor,
                          greedy: bool) -> Tensor:
    """The distribution FLy's gate reads (`[n, vocab]`): for "published" the softmax of the
    raw logits, always; for "specserve" `gate_distribution` (the processed p, raw if greedy)."""
    return gate_distribution(logits, target_probs, greedy or settings.published)


def gate_open(draft_tokens: Tensor, gate_probs: Tensor, settings: FlySettings) -> list[bool]:
    """Per draft: the gate (and for "specserve" the token condition) holds.
    draft_tokens [k]; gate_probs [>= k, vocab]."""
    k = draft_tokens.numel()
    if k == 0:
        return []
    rows = gate_probs[:k]  # [k, vocab]
    if settings.published:
        h = topk_entropy_nats(rows, settings.top_k).tolist()  # [k]
        return [x >= settings.entropy_threshold for x in h]
    h = normalized_topk_entropy(rows, settings.top_k).tolist()  # [k]
    m = min(settings.top_k, rows.shape[1])
    top = rows.topk(m, dim=-1).indices  # [k, m]
    index = draft_tokens.long().unsqueeze(1)  # [k, 1]
    among = (top == index).any(-1).tolist()  # [k]
    g_x = rows.gather(1, index).squeeze(1).tolist()  # [k] g_i(x_i)
    return [h[i] >= settings.entropy_threshold and among[i] and g_x[i] > 0 for i in range(k)]


def topk_entropy_nats(probs: Tensor, top_k: int) -> Tensor:
    """H_k of each row (float64 [n]): -sum of p log p over its min(k, vocab) largest
    probabilities, not renormalized, in nats; probs [n, vocab]. In [0, log k]."""
    rows = probs.reshape(-1, probs.shape[-1]).to(torch.float64)  # [n, vocab]
    top = rows.topk(min(top_k, rows.shape[1]), dim=-1).values  # [n, m]
    terms = torch.where(top > 0, -top * top.clamp_min(1e-300).log(), torch.zeros_like(top))
    return terms.sum(-1)  # [n]


def verify_fly(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
               uniforms: Tensor | list[float], residual_uniform: float, settings: FlySettings,
               gate_probs: Tensor | None = None, tv_budget: float | Sequence[float] = 0.0,
               bonus_token: bool = True) -> VerifyResult:
    """Verify one round with FLy on top of the native rule (see the module docstring).

    Arguments as `rejection.verify`, plus `settings` and `gate_probs` ([k + 1, vocab] or
    [k, vocab]; None: target_probs), whose top-k entropy the gate reads (the engine passes
    `fly_gate_distribution`).
    """
    drafts, budgets, us, residual_u = check_verify_args(draft_tokens, draft_probs, target_probs,
                                                        uniforms, residual_uniform, tv_budget)
    k = len(drafts)
    gate_probs = target_probs if gate_probs is None else gate_probs
    vocab = target_probs.shape[1]
    if gate_probs.dim() != 2 or gate_probs.shape[0] < k or gate_probs.shape[1] != vocab:
        raise ValueError(f"gate_probs must have shape [k (+ 1), vocab] = [{k}, "
                         f"{target_probs.shape[1]}], got {tuple(gate_probs.shape)}")

    native, tv = native_decisions(draft_tokens, draft_probs, target_probs, us, budgets,
                                  until_rejection=False)
    num_kept, deferred = _walk(native, gate_open(draft_tokens, gate_probs, settings),
                               settings.agreeing, settings.room)
    tv = tv[:num_kept + (num_kept < k)]
    for i in deferred:
        tv[i] = 1.0 - float(target_probs[i, drafts[i]].to(torch.float64))
    if num_kept < k:
        return reject_at(num_kept, drafts, draft_probs, target_probs, residual_u, tv)
    if bonus_token or k == 0:
        return VerifyResult(drafts + [sample_from(target_probs[k], residual_u)], k, "bonus", tv)
    return VerifyResult(drafts, k, "none", tv)


def _walk(native: list[bool], gate: list[bool], agreeing: int, room: int
          ) -> tuple[int, list[int]]:
    """Drafts kept before the round stops, and the positions kept by deferral: a rejection at
    i is deferred when its gate is open, i + room < k and the `agreeing` verdicts after it
    accept.

    E.g. native [T, F, T, T, F], gate [., T, ., ., T], agreeing = room = 2: position 1 defers
    (2 and 3 agree), position 4 has no room and stops the round: (4, [1]).
    """
    k = len(native)
    deferred = []
    for i in range(k):
        if native[i]:
            continue
        if gate[i] and i + room < k and all(native[i + 1:i + agreeing + 1]):
            deferred.append(i)
            continue
        return i, deferred
    return k, deferred
