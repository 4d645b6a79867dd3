"""Logits → processed probabilities: the one distribution that sampling and verification see.

Both the target verifier and the draft model call `processed_probs`, so the p and q that
the rejection sampler compares are always built the same way (the *processed*
distributions are what verification compares). The pipeline, in vLLM's order:

1. penalties, per row, from the tokens in that row's context:
   - repetition (vLLM / HF `RepetitionPenaltyLogitsProcessor`): a token present in the
     prompt *or* the output has its logit divided by the penalty when positive, multiplied
     when not;
   - frequency and presence (OpenAI): over *output* tokens only,
     `logit -= frequency * count + presence * (count > 0)`;
2. temperature; greedy parameters (see `SamplingParams.greedy`) give a one-hot at the
   argmax instead, ties going to the lowest token id;
3. top-k: keep the k largest logits (ties with the k-th are kept too);
4. top-p: keep the smallest set of most likely tokens whose mass is >= top_p (ties with the
   last one kept are kept too, so the result does not depend on sort order; at least one);
5. min-p: drop tokens whose probability is < min_p * the largest probability. The ratio does
   not change under renormalisation, so this is applied to the post-top-k probabilities and
   intersected with the top-p set.

Rows of `logits` are consecutive positions of one sequence, as in a verify pass: row i
scores the token that follows `history + draft_tokens[:i]`. Penalties touch only the
columns of tokens in the context; their counts are one bincount of the history plus, for
the draft tokens, a sparse cumulative one-hot (at most n²/2 entries).

Reference: Keskar et al. 2019 (CTRL) for the repetition penalty; Holtzman et al. 2019 for
top-p; Nguyen et al. 2024 (arXiv 2407.01082) for min-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from specserve.sampling.params import SamplingParams

# top-p first looks at this many most likely tokens and widens the search only when their
# mass is short of top_p: a top-k is much cheaper than a full sort of a 152k vocabulary.
TOP_P_CANDIDATES = 1024
TOP_P_WIDEN = 16  # 1024 → 16384 → the whole vocabulary


def needs_history(params: SamplingParams) -> bool:
    """True when the processed distribution depends on the tokens seen so far."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def processed_probs(
    logits: Tensor,
    params: SamplingParams,
    history: Sequence[int] | Tensor,
    prompt_len: int,
    draft_tokens: Tensor | None = None,
) -> Tensor:
    """Return the processed distribution of each row of `logits`, as float32 `[n, vocab]`.

    `logits` is `[n, vocab]` for n consecutive positions of one sequence; `history` is the
    sequence so far (prompt then output), of which the first `prompt_len` tokens are the
    prompt; `draft_tokens` (length >= n - 1, needed when n > 1) are the tokens proposed
    after `history`, so row i's context is `history + draft_tokens[:i]`. `history` and
    `draft_tokens` are only read when a penalty is set. The input is never modified.
    """
    assert logits.dim() == 2, f"logits must be [n, vocab], got {tuple(logits.shape)}"
    scores = logits.float()  # [n, vocab]; may alias `logits`: out-of-place ops only
    if needs_history(params):
        scores = _apply_penalties(scores, params, history, prompt_len, draft_tokens)
    if params.greedy:
        return _one_hot_argmax(scores)
    if params.temperature != 1.0:
        scores = scores / params.temperature  # [n, vocab]
    top_k_ids = None
    if 1 <= params.top_k < scores.shape[-1]:
        scores, top_k_ids = _top_k(scores, params.top_k)
    probs = torch.softmax(scores, dim=-1)  # [n, vocab]
    if params.top_p >= 1.0 and params.min_p <= 0.0:
        return probs
    threshold = params.min_p * probs.amax(dim=-1, keepdim=True)  # [n, 1]
    if params.top_p < 1.0:
        known = None if top_k_ids is None else probs.gather(-1, top_k_ids)  # [n, top_k]
        threshold = torch.maximum(threshold, _top_p_threshold(probs, params.top_p, known))
    kept = torch.where(probs >= threshold, probs, 0.0)  # [n, vocab]
    return kept.div_(kept.sum(dim=-1, keepdim=True))


def _apply_penalties(
    scores: Tensor,
    params: SamplingParams,
    history: Sequence[int] | Tensor,
    prompt_len: int,
    draft_tokens: Tensor | None,
) -> Tensor:
    """Apply the repetition, frequency and presence penalties to each row's context.

    Only the columns of tokens that occur in some row's context can change, so the work is
    done on those columns alone (`ids`, at most len(history) + n - 1 of them) and written
    back into a copy of `scores`.
    """
    num_rows, vocab = scores.shape
    device = scores.device
    seen = torch.as_tensor(history, dtype=torch.long, device=device)  # [len(history)]
    assert 0 <= prompt_len <= seen.numel(), "prompt_len must lie within the history"
    drafted = _draft_prefix(draft_tokens, num_rows, device)  # [n - 1]
    context = torch.cat([seen, drafted])  # [len(history) + n - 1]
    if context.numel() == 0:
        return scores
    assert 0 <= int(context.min()) and int(context.max()) < vocab, "token id outside vocab"
    ids, column = torch.unique(context, return_inverse=True)  # [u], [len(history) + n - 1]
    output_counts = _row_counts(
        column[prompt_len : seen.numel()], column[seen.numel() :], num_rows, ids.numel()
    )  # [n, u]
    sub = scores[:, ids]  # [n, u]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.bincount(column[:prompt_len], minlength=ids.numel()) > 0  # [u]
        present = in_prompt | (output_counts > 0)  # [n, u]
        penalty = params.repetition_penalty
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)  # [n, u]
        sub = torch.where(present, penalized, sub)
    sub = sub - params.frequency_penalty * output_counts  # [n, u]
    sub = sub - params.presence_penalty * (output_counts > 0).float()
    return scores.index_copy(1, ids, sub)


def _draft_prefix(draft_tokens: Tensor | None, num_rows: int, device: torch.device) -> Tensor:
    """The draft tokens that precede the last row: `draft_tokens[:n - 1]` as a long tensor."""
    if num_rows == 1:
        return torch.empty(0, dtype=torch.long, device=device)
    assert draft_tokens is not None and len(draft_tokens) >= num_rows - 1, (
        f"{num_rows} rows need at least {num_rows - 1} draft tokens"
    )
    drafted = torch.as_tensor(draft_tokens, dtype=torch.long, device=device)
    return drafted[: num_rows - 1]


def _row_counts(tokens: Tensor, drafted: Tensor, num_rows: int, width: int) -> Tensor:
    """Float counts `[n, width]` of each id in row i's context, `tokens + drafted[:i]`.

    One bincount of `tokens`, then a cumulative one-hot of the draft: draft token j is
    added to every row i > j. E.g. drafted = [7, 3], n = 3: row 0 adds nothing, row 1 adds
    {7}, row 2 adds {7, 3}.
    """
    counts = torch.bincount(tokens, minlength=width).float()  # [width]
    counts = counts.unsqueeze(0).repeat(num_rows, 1)  # [n, width]
    if num_rows > 1:
        rows, earlier = torch.tril_indices(num_rows, num_rows, offset=-1, device=tokens.device)
        ones = torch.ones(rows.numel(), device=tokens.device)  # [n * (n - 1) / 2]
        counts.index_put_((rows, drafted[earlier]), ones, accumulate=True)
    return counts


def greedy_scores(logits: Tensor, params: SamplingParams, history: Sequence[int] | Tensor,
                  prompt_len: int, draft_tokens: Tensor | None = None) -> Tensor:
    """What a greedy row's token is the argmax of (`argmax_rows`): the logits themselves
    where no penalty moves them (no one-hot `[n, vocab]` rows are built), else the processed
    one-hot rows (arguments as `processed_probs`)."""
    if not needs_history(params):
        return logits
    return processed_probs(logits, params, history, prompt_len, draft_tokens)


def argmax_rows(scores: Tensor) -> list[int]:
    """Each row's argmax of `[n, vocab]` scores (the lowest index among ties; a NaN counts
    as the largest, as in `torch.argmax`). On the host, float32 rows go through NumPy's
    vectorized search, much faster than `Tensor.argmax` on a large vocabulary
    (docs/design.md, "Host time of a step")."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        return scores.detach().numpy().argmax(axis=-1).tolist()
    return scores.argmax(dim=-1).tolist()


def _one_hot_argmax(scores: Tensor) -> Tensor:
    """One-hot float32 rows at each row's argmax (the lowest index among ties)."""
    best = torch.tensor(argmax_rows(scores), dtype=torch.long).unsqueeze(-1)  # [n, 1]
    return torch.zeros_like(scores, dtype=torch.float32).scatter_(-1, best, 1.0)


def _top_k(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Mask every logit below the k-th largest of its row to -inf (ties with it stay).

    Also returns the ids of the k largest, most likely first, which top-p reuses.
    """
    top = scores.topk(k, dim=-1)  # values and indices: [n, k], descending
    kth = top.values[:, -1:]  # [n, 1]
    return torch.where(scores >= kth, scores, -math.inf), top.indices


def _top_p_threshold(probs: Tensor, top_p: float, known: Tensor | None) -> Tensor:
    """Per-row probability `[n, 1]` at or above which tokens form the top-p set.

    The set is the smallest run of most likely tokens whose mass is >= top_p; returning
    its last probability keeps ties with it too. `known` may hold each row's most likely
    probabilities, descending (from top-k). The search looks at `TOP_P_CANDIDATES` tokens
    first and widens only when their mass falls short of top_p, so a peaked distribution
    never pays for a full sort.
    """
    vocab = probs.shape[-1]
    top = known if known is not None else probs.topk(min(vocab, TOP_P_CANDIDATES)).values
    while top.shape[-1] < vocab and not bool((top.sum(dim=-1) >= top_p).all()):
        top = probs.topk(min(vocab, top.shape[-1] * TOP_P_WIDEN), dim=-1).values  # [n, width]
    mass_before = torch.zeros_like(top)  # [n, width]: mass of the more likely tokens
    mass_before[:, 1:] = top[:, :-1].cumsum(dim=-1)
    # [n, 1]; at least the most likely token, also when top_p underflows in float32 (5e-324)
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
    return top.gather(-1, num_kept - 1)
