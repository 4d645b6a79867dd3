"""Prompt lookup (n-gram) drafting: propose the tokens that followed an earlier copy of the
last n tokens.

Text that quotes, edits or summarises its prompt repeats itself; prompt lookup (Saxena,
"Prompt Lookup Decoding", 2023; vLLM's `ngram` method) exploits that with no draft model:
take the last n tokens of prompt + output as a pattern, find its most recent earlier
occurrence, and propose the (up to) k tokens that came after it. n runs from
`prompt_lookup_max` down to `prompt_lookup_min`; the longest pattern that occurs wins.

E.g. tokens = [a b c d x a b c], max_n = 3: the pattern [a b c] occurs at 0..2, so the
draft is [d x a b c][:k]. An occurrence may overlap the pattern itself ([a a a a] with
n = 2 matches at 1..2 and proposes [a]) but never *is* the pattern: it must end before the
last position, so at least one token follows it.

The drafter is deterministic: proposals carry no distribution (one-hot for the verifier).
"""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence

import numpy as np

from specserve.speculative.candidate import NO_CANDIDATE, Candidate, TokenBuffer
from specserve.speculative.drafter import BuildContext, DraftSequence, Drafter


def find_ngram_draft(
    tokens: TokenSequence[int] | np.ndarray, k: int, max_n: int, min_n: int
) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` with length in [min_n, max_n]; [] when none occurs or k ≤ 0."""
    return find_ngram_match(tokens, k, max_n, min_n)[1]


def find_ngram_match(
    tokens: TokenSequence[int] | np.ndarray, k: int, max_n: int, min_n: int
) -> tuple[int, list[int]]:
    """(n, draft): the length of the longest suffix matched and `find_ngram_draft`'s draft
    ((0, []) when none occurs or k ≤ 0).

    One vectorised pass per n: `match[i]` says whether the last n tokens also end at
    position i + n − 1, built from the (n − 1)-match by one more comparison, so the cost is
    about max_n array comparisons whatever the text.
    """
    _check_lookup_bounds(max_n, min_n)
    if k <= 0:
        return 0, []
    arr = np.asarray(tokens)  # [length]
    length = arr.shape[0]
    max_n = min(max_n, length - 1)  # an earlier occurrence needs n + 1 tokens at least
    if max_n < min_n:
        return 0, []
    match = arr[: length - 1] == arr[length - 1]  # [length - 1] ends 0..length − 2
    best_end, best_n = -1, 0
    for n in range(1, max_n + 1):
        if n > 1:  # ends n − 1..length − 2; starts 0..length − n − 1
            match = match[1:] & (arr[: length - n] == arr[length - n])  # [length - n]
        last = _last_true(match)
        if last < 0:
            break
        if n >= min_n:
            best_end, best_n = last + n - 1, n
    if best_end < 0:
        return 0, []
    return best_n, arr[best_end + 1 : best_end + 1 + k].tolist()


def _last_true(mask: np.ndarray) -> int:
    """Index of the last True in a non-empty boolean vector, −1 if none."""
    i = mask.shape[0] - 1 - int(mask[::-1].argmax())
    return i if mask[i] else -1


def _check_lookup_bounds(max_n: int, min_n: int) -> None:
    if min_n < 1:
        raise ValueError(f"prompt_lookup_min must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(
            f"prompt_lookup_max must be >= prompt_lookup_min ({min_n}), got {max_n}"
        )


class NgramDrafter(Drafter):
    """The `ngram` method: prompt lookup over each sequence's prompt + output, as a lookup
    source of the speculation controller (`candidate`; every position's confidence is 1:
    one occurrence, no vote). The only per-sequence state is a token buffer that saves
    re-converting the whole sequence every round, dropped by `finish`."""

    name = "ngram"

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        _check_lookup_bounds(prompt_lookup_max, prompt_lookup_min)
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self._buffers: dict[int, TokenBuffer] = {}

    @classmethod
    def build(cls, config, ctx: BuildContext) -> NgramDrafter:
        return cls(config.prompt_lookup_max, config.prompt_lookup_min)

    def candidate(self, seq: DraftSequence, limit: int, extra: list[int] = ()) -> Candidate:
        """Up to `limit` tokens that followed the last earlier copy of the context's end (the
        context: the sequence's tokens, then `extra`)."""
        if limit <= 0:
            return NO_CANDIDATE
        tokens = self._buffers.setdefault(seq.seq_id, TokenBuffer()).sync(seq.token_ids)
        if extra:
            tokens = np.concatenate([tokens, np.asarray(extra, dtype=np.int64)])
        n, draft = find_ngram_match(tokens, limit, self.prompt_lookup_max,
                                    self.prompt_lookup_min)
        return Candidate(draft, [1.0] * len(draft), n) if draft else NO_CANDIDATE

    def finish(self, seq: DraftSequence, keep: bool = True) -> None:
        self._buffers.pop(seq.seq_id, None)
