"""Logits → processed probabilities: the one distribution that sampling and verification see.

Both the target verifier and the draft model call `processed_probs`, so the p and q that
the rejection sampler compares are always built the same way (SPEC §2: the *processed*
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
scores the token that follows `history + draft_tokens[:i]`. Token counts are one bincount
of the history plus, for the draft tokens, a sparse cumulative one-hot (at most n²/2
entries) — no per-row bincount.

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
    if 1 <= params.top_k < scores.shape[-1]:
        scores = _top_k(scores, params.top_k)
    probs = torch.softmax(scores, dim=-1)  # [n, vocab]
    if params.top_p >= 1.0 and params.min_p <= 0.0:
        return probs
    keep = torch.ones_like(probs, dtype=torch.bool)  # [n, vocab]
    if params.top_p < 1.0:
        keep &= _top_p_keep(probs, params.top_p)
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
    kept = probs * keep  # [n, vocab]
    return kept / kept.sum(dim=-1, keepdim=True)


def _apply_penalties(
    scores: Tensor,
    params: SamplingParams,
    history: Sequence[int] | Tensor,
    prompt_len: int,
    draft_tokens: Tensor | None,
) -> Tensor:
    """Apply the repetition, frequency and presence penalties to each row's context."""
    num_rows, vocab = scores.shape
    device = scores.device
    seen = torch.as_tensor(history, dtype=torch.long, device=device)  # [len(history)]
    assert 0 <= prompt_len <= seen.numel(), "prompt_len must lie within the history"
    drafted = _draft_prefix(draft_tokens, num_rows, device)  # [n - 1]
    output_counts = _row_counts(seen[prompt_len:], drafted, num_rows, vocab)  # [n, vocab]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.bincount(seen[:prompt_len], minlength=vocab) > 0  # [vocab]
        present = in_prompt | (output_counts > 0)  # [n, vocab]
        penalty = params.repetition_penalty
        penalized = torch.where(scores > 0, scores / penalty, scores * penalty)  # [n, vocab]
        scores = torch.where(present, penalized, scores)
    if params.frequency_penalty != 0.0:
        scores = scores - params.frequency_penalty * output_counts.float()
    if params.presence_penalty != 0.0:
        scores = scores - params.presence_penalty * (output_counts > 0).float()
    return scores


def _draft_prefix(draft_tokens: Tensor | None, num_rows: int, device: torch.device) -> Tensor:
    """The draft tokens that precede the last row: `draft_tokens[:n - 1]` as a long tensor."""
    if num_rows == 1:
        return torch.empty(0, dtype=torch.long, device=device)
    assert draft_tokens is not None and len(draft_tokens) >= num_rows - 1, (
        f"{num_rows} rows need at least {num_rows - 1} draft tokens"
    )
    drafted = torch.as_tensor(draft_tokens, dtype=torch.long, device=device)
    return drafted[: num_rows - 1]


def _row_counts(tokens: Tensor, drafted: Tensor, num_rows: int, vocab: int) -> Tensor:
    """Counts of each token id in row i's context, `tokens + drafted[:i]`: `[n, vocab]`.

    One bincount of `tokens`, then draft token j is added to every row i > j.
    E.g. drafted = [7, 3], n = 3: row 0 adds nothing, row 1 adds {7}, row 2 adds {7, 3}.
    """
    base = torch.bincount(tokens, minlength=vocab)  # [vocab]
    assert base.numel() == vocab, "a token id in the history is outside the vocabulary"
    counts = base.unsqueeze(0).repeat(num_rows, 1)  # [n, vocab]
    if num_rows > 1:
        rows, earlier = torch.tril_indices(num_rows, num_rows, offset=-1, device=tokens.device)
        ones = torch.ones_like(rows)  # [n * (n - 1) / 2]
        counts.index_put_((rows, drafted[earlier]), ones, accumulate=True)
    return counts


def _one_hot_argmax(scores: Tensor) -> Tensor:
    """One-hot float32 rows at each row's argmax (the lowest index among ties)."""
    best = scores.argmax(dim=-1, keepdim=True)  # [n, 1]
    return torch.zeros_like(scores, dtype=torch.float32).scatter_(-1, best, 1.0)


def _top_k(scores: Tensor, k: int) -> Tensor:
    """Mask every logit below the k-th largest of its row to -inf (ties with it stay)."""
    kth = scores.topk(k, dim=-1).values[:, -1:]  # [n, 1]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p_keep(probs: Tensor, top_p: float) -> Tensor:
    """Boolean mask `[n, vocab]` of the smallest most-likely set with mass >= top_p.

    Searches the `TOP_P_CANDIDATES` most likely tokens first and widens only when their
    mass falls short of top_p, so a peaked distribution never pays for a full sort.
    """
    vocab = probs.shape[-1]
    width = min(vocab, TOP_P_CANDIDATES)
    while True:
        top = probs.topk(width, dim=-1).values  # [n, width], descending
        if width == vocab or bool((top.sum(dim=-1) >= top_p).all()):
            break
        width = min(vocab, width * TOP_P_WIDEN)
    mass_before = torch.zeros_like(top)  # [n, width]: mass of the more likely tokens
    mass_before[:, 1:] = top[:, :-1].cumsum(dim=-1)
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [n, 1], >= 1
    threshold = top.gather(-1, num_kept - 1)  # [n, 1]
    return probs >= threshold
