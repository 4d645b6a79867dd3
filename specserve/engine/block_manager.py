"""Who holds which KV block: a block allocator with reference counts and prefix caching.

A model's KV pools (`models/kv_cache.py`) are cut into `num_blocks` blocks of `block_size`
positions. Each sequence has a `BlockTable`: the blocks of its positions, in order. Blocks
come from a free list; a sequence gets blocks by the tokens it holds, never by a maximum
length.

Prefix caching: a *full* block of *committed* tokens (positions the sequence will never
rewrite: a rollback only moves the cached length back to a position past them) is
registered under the key (key of the block before it, the block's tokens). Keys are exact
(the dictionary compares the tuples; a parent is named by a unique node number that is
never reused), so two blocks share a key only when every token up to their end agrees. A new
sequence walks its prompt block by block and takes every registered block it finds, by
reference (its count goes up); it then computes only the rest. A registered block that no
sequence holds stays cached until the allocator needs a block and nothing is free: then
the least recently released goes (LRU). A block is written only by the sequence that
allocated it, and only before it is full and committed, so a shared block is never written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

_ROOT = 0  # the key node of the empty prefix


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks in one model's cache."""

    blocks: list[int] = field(default_factory=list)
    num_registered: int = 0  # leading blocks keyed in the prefix cache (taken, or registered)
    node: int = _ROOT  # key node of the last registered block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 on_free: Callable[[BlockTable], None] | None = None) -> None:
        """`on_free(table)`: called when a table is freed (a model's per-sequence state other
        than KV blocks, such as recurrent state, goes with it)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.on_free = on_free
        # a stack, lowest ids on top: a block freed is the next one taken, so the pages the
        # OS mapped for the pools stay few while few blocks are in use
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # [num_blocks] tables holding each block
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}  # key → block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block → key
        self._node_of: dict[int, int] = {}  # registered block → its key node
        self._next_node = _ROOT + 1
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest first
        self.high_water = 0  # blocks 0..high_water − 1 were taken at some point (their pages mapped)

    @staticmethod
    def new_table() -> BlockTable:
        return BlockTable()

    # ------------------------------------------------------------------ accounting
    @property
    def num_available(self) -> int:
        """Blocks a table could get now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ tables
    def reserve(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow `table` to hold `num_tokens` positions; all or nothing (False: not enough
        blocks, the table is unchanged)."""
        need = self.blocks_for(num_tokens) - len(table.blocks)
        if need <= 0:
            return True
        if need > self.num_available:
            return False
        for _ in range(need):
            table.blocks.append(self._take())
        return True

    def free(self, table: BlockTable) -> None:
        """Release every block of `table` (newest first, so a cached prefix's tail is evicted
        before its head) and empty it."""
        for block in reversed(table.blocks):
            self._release(block)
        table.blocks.clear()
        table.num_registered, table.node = 0, _ROOT
        if self.on_free is not None:
            self.on_free(table)

    def match_prefix(self, table: BlockTable, tokens: list[int], max_tokens: int) -> int:
        """Take the registered blocks that continue `table` over `tokens`, up to `max_tokens`
        positions; returns the positions `table` now holds computed. Only for an empty table
        (a new or freed sequence)."""
        assert not table.blocks, "match_prefix on a table that holds blocks"
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        while (len(table.blocks) + 1) * bs <= max_tokens:
            start = len(table.blocks) * bs
            block = self._by_key.get((table.node, tuple(tokens[start:start + bs])))
            if block is None:
                break
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
            table.blocks.append(block)
            table.num_registered += 1
            table.node = self._node_of[block]
        return len(table.blocks) * bs

    def register(self, table: BlockTable, tokens: list[int], num_committed: int) -> None:
        """Register the full blocks among `table`'s first `num_committed` positions (their
        keys and values are final: computed from `tokens[:num_committed]`)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(num_committed // bs, len(table.blocks))
        while table.num_registered < full:
            i = table.num_registered
            block = table.blocks[i]
            key = (table.node, tuple(tokens[i * bs:(i + 1) * bs]))
            table.num_registered += 1
            twin = self._by_key.get(key)
            if twin is not None:  # another sequence registered the same tokens first: ours
                table.node = self._node_of[twin]  # stays private, the key chain goes on
                continue
            self._by_key[key] = block
            self._key_of[block] = key
            self._node_of[block] = self._next_node
            table.node = self._next_node
            self._next_node += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no table holds (they become free); blocks some table
        holds stay as they are. Returns how many were dropped."""
        dropped = len(self._idle)
        for block in self._idle:
            del self._by_key[self._key_of.pop(block)]
            del self._node_of[block]
            self._free.append(block)
        self._idle.clear()
        return dropped

    # ------------------------------------------------------------------ blocks
    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
            self.high_water = max(self.high_water, block + 1)
        else:  # evict the least recently released cached block
            block, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
            del self._node_of[block]
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        assert self._refs[block] >= 0, f"block {block} released twice"
        if self._refs[block] == 0:
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
