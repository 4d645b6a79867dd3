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

from specserve.speculative.drafter import EMPTY, DraftSequence, Proposal


def find_ngram_draft(
    tokens: TokenSequence[int] | np.ndarray, k: int, max_n: int, min_n: int
) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` with length in [min_n, max_n]; [] when none occurs or k ≤ 0.

    One vectorised pass per n: `match[i]` says whether the last n tokens also end at
    position i + n − 1, built from the (n − 1)-match by one more comparison, so the cost is
    about max_n array comparisons whatever the text.
    """
    _check_lookup_bounds(max_n, min_n)
    if k <= 0:
        return []
    arr = np.asarray(tokens)  # [length]
    length = arr.shape[0]
    max_n = min(max_n, length - 1)  # an earlier occurrence needs n + 1 tokens at least
    if max_n < min_n:
        return []
    match = arr[: length - 1] == arr[length - 1]  # [length - 1] ends 0..length − 2
    best_end = -1
    for n in range(1, max_n + 1):
        if n > 1:  # ends n − 1..length − 2; starts 0..length − n − 1
            match = match[1:] & (arr[: length - n] == arr[length - n])  # [length - n]
        last = _last_true(match)
        if last < 0:
            break
        if n >= min_n:
            best_end = last + n - 1
    if best_end < 0:
        return []
    return arr[best_end + 1 : best_end + 1 + k].tolist()


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


class _TokenBuffer:
    """A growing int64 copy of one sequence's `token_ids`, so a round converts only the
    tokens appended since the last one instead of the whole list."""

    __slots__ = ("data", "length")

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)  # [capacity]
        self.length = 0

    def sync(self, token_ids: TokenSequence[int]) -> np.ndarray:
        """The buffer's view of `token_ids`, which only grow between rounds; as a cheap guard
        (not a proof) the buffer is rebuilt when it is longer or its last token differs."""
        total = len(token_ids)
        last = self.length - 1
        if self.length > total or (last >= 0 and token_ids[last] != self.data[last]):
            self.length = 0
        if total > self.length:
            self._append(token_ids[self.length :], total)
        return self.data[:total]  # [length]

    def _append(self, new_ids: TokenSequence[int], total: int) -> None:
        if total > self.data.shape[0]:
            grown = np.empty(max(total, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : total] = np.fromiter(new_ids, np.int64, total - self.length)
        self.length = total


class NgramDrafter:
    """The `ngram` method: prompt lookup over each sequence's prompt + output.

    `num_speculative_tokens` is the configured k (−1: adaptive); the `ks` the engine passes
    to `propose` decide each round. The only per-sequence state is a token buffer that
    saves re-converting the whole sequence every round; it is created lazily, so `start`
    is optional, and dropped by `finish`.
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1
    ) -> None:
        if num_speculative_tokens < -1:
            raise ValueError(
                "num_speculative_tokens must be >= 0 or -1 (adaptive), "
                f"got {num_speculative_tokens}"
            )
        _check_lookup_bounds(prompt_lookup_max, prompt_lookup_min)
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self._buffers: dict[int, _TokenBuffer] = {}

    def start(self, seq: DraftSequence) -> None:
        self._buffers[seq.seq_id] = _TokenBuffer()
        self._buffers[seq.seq_id].sync(seq.token_ids)

    def ready(self, seq: DraftSequence) -> bool:
        return True

    def started(self, seq: DraftSequence) -> bool:
        return True  # nothing to start: lookups need no prefill

    def startup_tokens(self, seq: DraftSequence) -> int:
        return 0

    def activate(self, seq: DraftSequence) -> None:
        pass

    def pending(self) -> bool:
        return False

    def propose(self, seqs: list[DraftSequence], ks: list[int]) -> list[Proposal]:
        assert len(seqs) == len(ks), "one k per sequence"
        return [self._propose_one(seq, k) for seq, k in zip(seqs, ks)]

    def commit(self, seq: DraftSequence, num_accepted: int, old_len: int) -> None:
        """Nothing to roll back: the next `propose` reads the committed `token_ids`."""

    def finish(self, seq: DraftSequence) -> None:
        self._buffers.pop(seq.seq_id, None)

    def _propose_one(self, seq: DraftSequence, k: int) -> Proposal:
        if k <= 0:
            return EMPTY
        tokens = self._buffers.setdefault(seq.seq_id, _TokenBuffer()).sync(seq.token_ids)
        draft = find_ngram_draft(tokens, k, self.prompt_lookup_max, self.prompt_lookup_min)
        return Proposal(draft, None) if draft else EMPTY
