"""What a lookup source offers the speculation controller: a candidate continuation with a
confidence per position, and the per-sequence token buffer the lookups search."""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Candidate:
    """A suffix draft: `tokens` [n], `confidence` [n] (each position's share of the votes),
    `match_len` (how many context tokens the voting occurrences matched) and where they came
    from (`from_cache`: at least one voter was an earlier request's output)."""

    tokens: list[int]
    confidence: list[float]
    match_len: int
    from_cache: bool = False


NO_CANDIDATE = Candidate([], [], 0)


class TokenBuffer:
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
