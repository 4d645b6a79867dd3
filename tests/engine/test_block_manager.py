"""The block manager: all-or-nothing growth, reference counts, prefix keys, LRU eviction."""

from __future__ import annotations

from specserve.engine.block_manager import BlockManager, BlockTable

BS = 4


def test_reserve_is_all_or_nothing_and_free_returns_every_block():
    m = BlockManager(5, BS)
    a, b = BlockTable(), BlockTable()
    assert m.reserve(a, 9) and len(a.blocks) == 3  # ceil(9 / 4)
    assert not m.reserve(b, 9) and b.blocks == []  # 3 needed, 2 left: nothing taken
    assert m.reserve(b, 8) and m.num_available == 0
    assert m.reserve(a, 12)  # already held
    m.free(a)
    assert m.num_available == 3 and a.blocks == []
    m.free(b)
    assert m.num_used == 0


def test_a_registered_prefix_is_shared_by_reference_and_only_full_committed_blocks_count():
    m = BlockManager(8, BS)
    tokens = list(range(10))
    a = BlockTable()
    m.reserve(a, 10)
    m.register(a, tokens, 10)  # blocks 0..1 full and committed; block 2 holds 2 positions
    assert a.num_registered == 2
    b = BlockTable()
    assert m.match_prefix(b, tokens + [99], 11) == 8
    assert b.blocks == a.blocks[:2]
    assert m.num_used == 3  # shared blocks counted once
    # a prompt that differs inside the second block shares only the first
    c = BlockTable()
    assert m.match_prefix(c, tokens[:6] + [50, 51, 52], 9) == 4
    # max_tokens bounds the match (a fresh prompt keeps its last position to compute)
    d = BlockTable()
    assert m.match_prefix(d, tokens[:8], 7) == 4


def test_keys_include_everything_before_the_block():
    m = BlockManager(8, BS)
    a = BlockTable()
    m.reserve(a, 8)
    m.register(a, [1, 2, 3, 4, 5, 6, 7, 8], 8)
    b = BlockTable()  # same second block, different first block: no match at all
    assert m.match_prefix(b, [9, 9, 9, 9, 5, 6, 7, 8], 8) == 0


def test_unheld_cached_blocks_are_evicted_least_recently_released_first():
    m = BlockManager(4, BS)
    old, new = BlockTable(), BlockTable()
    m.reserve(old, 4)
    m.register(old, [1, 1, 1, 1], 4)
    m.reserve(new, 4)
    m.register(new, [2, 2, 2, 2], 4)
    m.free(old)
    m.free(new)
    assert m.num_available == 4 and m.num_used == 0
    grab = BlockTable()
    assert m.reserve(grab, 12)  # the two free blocks, then the oldest cached one
    assert m.match_prefix(BlockTable(), [1, 1, 1, 1, 0], 5) == 0  # evicted
    kept = BlockTable()
    assert m.match_prefix(kept, [2, 2, 2, 2, 0], 5) == 4  # still cached, now held again
    assert m.num_available == 0


def test_the_same_tokens_registered_twice_keep_one_cached_copy():
    m = BlockManager(6, BS)
    a, b = BlockTable(), BlockTable()
    for t in (a, b):  # two sequences prefilled the same prompt at the same time
        m.reserve(t, 8)
        m.register(t, list(range(8)), 8)
    c = BlockTable()
    assert m.match_prefix(c, list(range(9)), 9) == 8
    assert c.blocks == a.blocks
    assert m.num_available == 2
    m.free(b)  # b's private copies go straight back to the free list
    assert m.num_available == 4
    m.free(a)
    m.free(c)
    assert m.num_available == 6


def test_reset_prefix_cache_frees_unheld_cached_blocks_and_keeps_held_ones():
    m = BlockManager(6, BS)
    held, gone = BlockTable(), BlockTable()
    m.reserve(held, 4)
    m.register(held, [1, 1, 1, 1], 4)
    m.reserve(gone, 8)
    m.register(gone, [2, 2, 2, 2, 3, 3, 3, 3], 8)
    m.free(gone)
    assert m.reset_prefix_cache() == 2
    assert m.match_prefix(BlockTable(), [2, 2, 2, 2, 3, 3, 3, 3, 0], 9) == 0
    again = BlockTable()
    assert m.match_prefix(again, [1, 1, 1, 1, 0], 5) == 4  # held: still cached
    assert m.num_used == 1 and m.num_available == 5
    grab = BlockTable()
    assert m.reserve(grab, 20) and sorted(grab.blocks) == sorted({0, 1, 2, 3, 4, 5} - set(held.blocks))
    assert m.reset_prefix_cache() == 0


def test_high_water_counts_the_blocks_ever_taken_and_recycled_blocks_come_first():
    m = BlockManager(8, BS)
    a, b = BlockTable(), BlockTable()
    m.reserve(a, 12)  # blocks 0..2
    assert m.high_water == 3
    m.free(a)  # unregistered: back on the free stack, taken again before untouched ones
    m.reserve(b, 8)
    assert m.high_water == 3 and sorted(b.blocks) == [0, 1]
    m.register(b, list(range(8)), 8)
    m.free(b)  # cached, unheld: kept, so the next table touches a new block
    c = BlockTable()
    m.reserve(c, 8)
    assert m.high_water == 4
