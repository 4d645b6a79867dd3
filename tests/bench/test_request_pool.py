"""The distinct requests of the busy-server measurements: no text twice, the task kinds
interleaved, and "mixed-even" holding about the same mix in any stretch."""

from __future__ import annotations

import pytest

from specserve.bench.request_pool import POOLS, distinct_pool


@pytest.mark.parametrize("which", POOLS)
def test_no_text_comes_twice(which):
    pool = distinct_pool(which)
    assert len(pool) >= 160 and len({text for _, text in pool}) == len(pool)


def test_mixed_interleaves_three_tasks_with_one_story_while_the_tasks_last():
    kinds = [kind for kind, _ in distinct_pool("mixed")]
    assert kinds[:8] == ["code_edit", "arithmetic", "extraction", "story"] * 2
    assert set(kinds[48:]) == {"story"}


def test_mixed_even_spreads_the_tasks_through_the_whole_list():
    kinds = [kind for kind, _ in distinct_pool("mixed-even")]
    assert sorted(kinds) == sorted(kind for kind, _ in distinct_pool("mixed"))
    for start in range(0, len(kinds) - 32, 8):
        window = kinds[start:start + 32]
        assert 4 <= sum(k != "story" for k in window) <= 8, start


def test_stories_hold_no_task_and_a_bad_name_is_refused():
    assert {kind for kind, _ in distinct_pool("stories")} == {"story"}
    with pytest.raises(ValueError, match="pool must be one of"):
        distinct_pool("mixd")


def test_long_requests_are_long_distinct_and_take_the_kinds_in_turn():
    pool = distinct_pool("long")
    kinds = [kind for kind, _ in pool]
    assert kinds[:8] == ["code_edit", "explain", "review", "docs"] * 2
    assert min(len(text) for _, text in pool) >= 3000
