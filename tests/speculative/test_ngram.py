"""Tests for prompt lookup: `find_ngram_draft` on hand-made and random arrays, its speed, and
`NgramDrafter` over sequences that grow round by round."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specserve.speculative.ngram import NgramDrafter, find_ngram_draft


def reference_draft(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The rule read literally: longest n first, most recent earlier end first."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        pattern = tokens[length - n :] if n <= length else None
        for end in range(length - 2, n - 2, -1):
            if pattern is not None and tokens[end - n + 1 : end + 1] == pattern:
                return tokens[end + 1 : end + 1 + k] if k > 0 else []
    return []


def test_longest_match_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 9, 5, 2, 8, 1, 2]  # [1 2] at 0..1 (then 9); a lone 2 at 4 (then 8)
    assert find_ngram_draft(tokens, k=3, max_n=2, min_n=1) == [9, 5, 2]
    assert find_ngram_draft(tokens, k=3, max_n=1, min_n=1) == [8, 1, 2]


def test_most_recent_occurrence_wins_among_equal_lengths():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert find_ngram_draft(tokens, k=2, max_n=2, min_n=1) == [4, 1]


def test_no_occurrence_gives_an_empty_draft():
    assert find_ngram_draft([1, 2, 3, 4], k=4, max_n=3, min_n=1) == []
    assert find_ngram_draft([7], k=4, max_n=3, min_n=1) == []
    assert find_ngram_draft([], k=4, max_n=3, min_n=1) == []


def test_occurrence_right_before_the_suffix_proposes_the_one_token_after_it():
    assert find_ngram_draft([5, 7, 7], k=5, max_n=3, min_n=1) == [7]
    # Overlapping the pattern is allowed: [a a] ends at 2, so [a] follows.
    assert find_ngram_draft([3, 3, 3, 3], k=5, max_n=2, min_n=2) == [3]


def test_draft_is_clipped_by_k_and_by_what_follows():
    tokens = [4, 5, 6, 7, 8, 4, 5]
    assert find_ngram_draft(tokens, k=2, max_n=2, min_n=1) == [6, 7]
    assert find_ngram_draft(tokens, k=10, max_n=2, min_n=1) == [6, 7, 8, 4, 5]


def test_min_n_rejects_shorter_matches():
    tokens = [1, 2, 9, 5, 2]  # only the 1-gram [2] occurs earlier
    assert find_ngram_draft(tokens, k=3, max_n=3, min_n=1) == [9, 5, 2]
    assert find_ngram_draft(tokens, k=3, max_n=3, min_n=2) == []


def test_nonpositive_k_gives_an_empty_draft():
    assert find_ngram_draft([1, 2, 1, 2], k=0, max_n=2, min_n=1) == []
    assert find_ngram_draft([1, 2, 1, 2], k=-1, max_n=2, min_n=1) == []


@pytest.mark.parametrize(("max_n", "min_n", "field"), [(3, 0, "prompt_lookup_min"),
                                                      (1, 2, "prompt_lookup_max")])
def test_bad_lookup_bounds_raise_naming_the_field(max_n, min_n, field):
    with pytest.raises(ValueError, match=field):
        find_ngram_draft([1, 2, 1], k=1, max_n=max_n, min_n=min_n)
    with pytest.raises(ValueError, match=field):
        NgramDrafter(prompt_lookup_max=max_n, prompt_lookup_min=min_n)


def test_matches_the_literal_rule_on_random_small_vocabularies():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 30))).tolist()
        max_n = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        k = int(rng.integers(0, 6))
        expected = reference_draft(tokens, k, max_n, min_n)
        assert find_ngram_draft(tokens, k, max_n, min_n) == expected, (tokens, k, max_n, min_n)
        assert find_ngram_draft(np.array(tokens, dtype=np.int32), k, max_n, min_n) == expected


def fake_seq(seq_id: int, token_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, token_ids=token_ids)


def test_drafter_offers_each_sequence_its_own_lookup_with_full_confidence():
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    a, b = fake_seq(0, [1, 2, 3, 4, 1, 2]), fake_seq(1, [9, 8, 7])
    got = drafter.candidate(a, 3)
    assert got.tokens == [3, 4, 1] and got.confidence == [1.0] * 3 and got.match_len == 2
    assert drafter.candidate(b, 3).tokens == []  # no match
    assert drafter.candidate(a, 0).tokens == []


def test_drafter_follows_the_sequence_as_rounds_append_tokens():
    rng = np.random.default_rng(2)
    drafter = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    seq = fake_seq(7, rng.integers(0, 6, 20).tolist())
    for _ in range(300):  # grows past the buffer's initial capacity
        assert drafter.candidate(seq, 5).tokens == reference_draft(seq.token_ids, 5, 3, 1)
        seq.token_ids.extend(rng.integers(0, 6, int(rng.integers(1, 4))).tolist())


def test_drafter_rebuilds_when_a_reused_id_holds_different_tokens():
    drafter = NgramDrafter()
    drafter.candidate(fake_seq(0, [1, 2, 3, 1, 2]), 3)
    replaced = fake_seq(0, [5, 6, 5, 6, 5, 6, 7, 5])  # same id, other tokens, longer
    assert drafter.candidate(replaced, 3).tokens == [6, 7, 5]
    shorter = fake_seq(0, [4, 4])
    assert drafter.candidate(shorter, 3).tokens == [4]


def test_drafter_forgets_finished_sequences():
    drafter = NgramDrafter()
    seq = fake_seq(3, [1, 2, 1])
    assert drafter.candidate(seq, 2).tokens == [2, 1]
    drafter.finish(seq)
    drafter.finish(seq)  # finishing twice is harmless
    assert drafter._buffers == {}
