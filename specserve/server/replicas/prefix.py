"""Which replica holds a prompt's prefix: a bounded map from hashed token blocks to replica ids.

Each replica's engine caches KV blocks of `block` tokens by prefix (the paged engine's prefix
cache), so a request whose leading blocks were last computed on replica R is cheapest on R. The
index records, for every finished request, the chain hash of each leading block of its prompt +
output tokens (a chat's next turn repeats exactly those), and answers the replica whose recorded
chain matches the longest run of a new prompt's leading blocks. Least recently used chains are
forgotten past `capacity`. Pure Python: no Ray, no engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Match:
    replica: str | None  # the replica holding the longest recorded prefix (None: no match)
    tokens: int  # how many leading prompt tokens it holds


def block_hashes(token_ids: Sequence[int], block: int) -> list[int]:
    """One hash per full leading block; hash i covers tokens [0, (i + 1) * block)."""
    hashes, h = [], 0
    for start in range(0, len(token_ids) - block + 1, block):
        h = hash((h, tuple(token_ids[start:start + block])))
        hashes.append(h)
    return hashes


class PrefixIndex:
    def __init__(self, block: int = 16, capacity: int = 100_000) -> None:
        if block < 1 or capacity < 1:
            raise ValueError(f"block and capacity must be >= 1, got {block}, {capacity}")
        self.block, self.capacity = block, capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # chain hash -> replica id

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, token_ids: Sequence[int], replica: str) -> None:
        """`replica` now holds every full leading block of `token_ids`."""
        for h in block_hashes(token_ids, self.block):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def lookup(self, token_ids: Sequence[int], alive: set[str] | None = None) -> Match:
        """The replica (among `alive`, when given) with the longest run of leading blocks."""
        best = Match(None, 0)
        for i, h in enumerate(block_hashes(token_ids, self.block)):
            owner = self._owner.get(h)
            if owner is None:
                break  # chain hashes: a missing block means no longer prefix is recorded
            if alive is None or owner in alive:
                best = Match(owner, (i + 1) * self.block)
        return best

    def forget(self, replica: str) -> None:
        """Drop everything recorded for a replica that is gone (its cache died with it)."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
