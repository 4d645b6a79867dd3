"""Suffix drafting: matches in the request and in the shared cache, votes, eviction, bounds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specserve.speculative.suffix import (KEY_LEN, MAX_VIEW_TOKENS, PROMPT_CONTEXT, SuffixCache,
                                         SuffixDrafter, escaped_view, vote)


def seq(seq_id: int, tokens: list[int], prompt_len: int = 0) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), prompt_len=prompt_len)


def test_the_longest_earlier_suffix_is_continued():
    drafter = SuffixDrafter()
    got = drafter.candidate(seq(0, [1, 2, 3, 4, 9, 1, 2, 3]))
    assert got.tokens == [4, 9, 1, 2, 3] and got.match_len == 3
    assert got.confidence == [1.0] * 5 and not got.from_cache


def test_no_earlier_occurrence_gives_no_candidate():
    assert SuffixDrafter().candidate(seq(0, [1, 2, 3, 4, 5])).tokens == []
    assert SuffixDrafter().candidate(seq(0, [7])).tokens == []


def test_occurrences_vote_and_the_share_is_the_confidence():
    # "1 2" is followed by 3, 3, 3 and then 4: the longest match is "1 2" (length 2; "x 1 2"
    # never recurs), three of four voters say 3; those three then agree on 5 for the next.
    tokens = [1, 2, 3, 5, 0, 1, 2, 3, 5, 6, 1, 2, 4, 8, 7, 1, 2, 3, 5, 9, 1, 2]
    got = SuffixDrafter(min_confidence=0.0).candidate(seq(0, tokens))
    assert got.match_len == 2
    assert got.tokens[:2] == [3, 5]
    assert got.confidence[:2] == [pytest.approx(3 / 4), 1.0]


def test_vote_ties_go_to_the_most_recent_occurrence_and_stop_below_min_confidence():
    recent, old = np.array([7, 1]), np.array([8, 1])
    assert vote([recent, old], 4, 0.0) == ([7, 1], [0.5, 1.0])
    assert vote([recent, old], 4, 0.6) == ([], [])  # 0.5 < 0.6 at the first position
    # the product of shares decides: 1, then 2/3, then 1/2 → stops once below 0.4
    a, b, c = np.array([1, 2, 3, 4]), np.array([1, 2, 5, 4]), np.array([1, 6, 3, 4])
    tokens, shares = vote([a, b, c], 4, 0.4)
    assert tokens == [1, 2] and shares == [1.0, pytest.approx(2 / 3)]


def test_a_long_match_drafts_long_and_max_draft_caps_it():
    text = list(range(40))
    got = SuffixDrafter(max_draft=16).candidate(seq(0, text + text[:10]))
    assert got.tokens == list(range(10, 26)) and got.match_len == 10


def test_a_second_request_drafts_from_the_first_ones_output():
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    first = seq(0, [100, 101] + [5, 6, 7, 8, 9, 10, 11, 12], prompt_len=2)
    drafter.finish(first)  # completed: its output joins the cache
    second = seq(1, [200, 201, 5, 6, 7], prompt_len=2)
    got = drafter.candidate(second)
    assert got.tokens == [8, 9, 10, 11, 12] and got.from_cache and got.match_len == 3
    # an aborted request's output is not kept
    drafter.finish(seq(2, [1, 30, 31, 32, 33, 34], prompt_len=1), keep=False)
    assert drafter.candidate(seq(3, [30, 31, 32])).tokens == []


def test_an_answer_drafts_its_opening_from_earlier_answers_after_the_same_prompt_tail():
    # every answer follows the chat template's tail (here 90 91 92 93); earlier answers opened
    # with 5 6 7 8 9: a new request whose first token is 5 drafts the rest of the opening
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    tail = [90, 91, 92, 93]
    for i in range(2):
        prompt = [300 + i] * 30 + tail
        drafter.finish(seq(i, prompt + [5, 6, 7, 8, 9, 40 + i], prompt_len=len(prompt)))
    doc = next(reversed(cache.docs.values()))
    assert len(doc) == PROMPT_CONTEXT + 6  # the prompt's last PROMPT_CONTEXT tokens lead it
    new = [400] * 30 + tail + [5]
    got = drafter.candidate(seq(9, new, prompt_len=len(new) - 1))
    assert got.tokens[:4] == [6, 7, 8, 9] and got.from_cache and got.match_len == 5
    assert got.confidence[:4] == [1.0] * 4 and got.confidence[4] == 0.5
    # the lead is matched, never proposed: a context ending inside it continues nothing
    assert drafter.candidate(seq(10, [7, 301, 90, 91], prompt_len=4)).tokens == []


def test_a_lead_is_evicted_with_its_output_and_must_fit_the_document():
    cache = SuffixCache(max_tokens=20)
    cache.add([1, 2, 3, 4, 5, 6, 7, 8], lead=4)
    assert cache.occurrences(np.array([1, 2, 3, 4]), 8)[0][0] == 4  # matched up to the lead
    assert not cache.occurrences(np.array([1, 2, 3]), 8)  # an end inside the lead: not indexed
    cache.add(list(range(10, 24)))  # 8 + 14 > 20: the first document goes, keys and all
    assert list(cache.docs) == [1] and not cache.occurrences(np.array([2, 3, 4]), 8)
    assert all(doc in cache.docs for doc, _ in cache.entries())
    with pytest.raises(ValueError, match="lead"):
        cache.add([1, 2, 3], lead=4)


def test_the_cache_evicts_least_recently_used_outputs_past_its_bound():
    cache = SuffixCache(max_tokens=12)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([11, 12, 13, 14, 15, 16])
    assert cache.num_tokens == 12
    context = np.array([9, 1, 2, 3])
    assert cache.occurrences(context, 8)  # uses the first output: now the most recent
    cache.add([21, 22, 23, 24, 25, 26])  # evicts the least recently used: the second
    assert cache.num_tokens == 12 and len(cache.docs) == 2
    assert not cache.occurrences(np.array([11, 12, 13]), 8)
    assert cache.occurrences(np.array([1, 2, 3]), 8)
    # the evicted output's index entries went with it: memory follows the tokens kept
    assert all(doc in cache.docs for doc, _ in cache.entries())
    assert sum(len(e) for e in cache.index.values()) <= KEY_LEN * cache.num_tokens


def test_memory_stays_bounded_under_a_stream_of_outputs():
    rng = np.random.default_rng(0)
    cache = SuffixCache(max_tokens=2000)
    for _ in range(300):
        cache.add(rng.integers(0, 50, int(rng.integers(5, 60))).tolist())
        assert cache.num_tokens <= 2000
    entries = sum(len(e) for e in cache.index.values())
    assert entries <= KEY_LEN * cache.num_tokens  # a key of each length per kept token at most
    assert all(doc in cache.docs for doc, _ in cache.entries())


def test_outputs_too_short_for_a_key_or_too_long_for_the_cache_are_not_kept():
    cache = SuffixCache(max_tokens=10)
    cache.add([1] * KEY_LEN)
    cache.add(list(range(11)))
    assert cache.num_tokens == 0 and not cache.index


def test_cache_matches_are_extended_backwards_and_the_longest_wins():
    cache = SuffixCache()
    cache.add([1, 2, 3, 4, 5, 50])  # "3 4 5" after "1 2": match length 5
    cache.add([9, 3, 4, 5, 60, 61])  # "3 4 5" after "9": match length 3
    got = SuffixDrafter(cache).candidate(seq(0, [1, 2, 3, 4, 5]))
    assert got.match_len == 5 and got.tokens == [50]


def test_a_short_cache_match_continues_only_where_the_request_matches_less():
    # earlier tool calls closed a string value with 7 ("\"\n"), then 8 9 ("  }\n}"): the
    # new call closes its value after tokens no output had before it (no 3- or 2-gram
    # recurs), so the last token alone finds its continuation in the cache
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    for i in range(2):
        drafter.finish(seq(i, [50, 60 + i, 61 + i, 7, 8, 9], prompt_len=1))
    got = drafter.candidate(seq(5, [70, 71, 72, 7], prompt_len=3))
    assert got.tokens == [8, 9] and got.match_len == 1 and got.from_cache
    assert got.confidence == [1.0, 1.0]
    # where the request's own text matches as long, its own occurrences alone vote
    got = drafter.candidate(seq(6, [7, 4, 70, 7], prompt_len=3))
    assert got.tokens == [4, 70, 7] and got.match_len == 1 and not got.from_cache
    # and a longer own match is never outvoted by short cached ones
    got = drafter.candidate(seq(7, [3, 7, 5, 3, 7], prompt_len=4))
    assert got.match_len == 2 and got.tokens[0] == 5 and not got.from_cache
    # the short keys go with their document
    small = SuffixCache(max_tokens=6)
    small.add([1, 2, 3, 4, 5, 6])
    small.add([11, 12, 13, 14, 15, 16])
    assert not small.occurrences(np.array([9, 9, 2]), 8, min_key=1)
    assert small.occurrences(np.array([9, 9, 12]), 8, min_key=1)[0][0] == 1
    assert set(small.index) == {key for n in range(1, KEY_LEN + 1)
                                for key in zip(*(range(11 + i, 16) for i in range(n)))}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_draft"):
        SuffixDrafter(max_draft=0)
    with pytest.raises(ValueError, match="min_confidence"):
        SuffixDrafter(min_confidence=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(max_tokens=-1)
    with pytest.raises(ValueError, match="min_key"):
        SuffixCache(min_key=KEY_LEN + 1)


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    """The tests' character-level tokenizer (tests/tiny.py)."""
    from specserve.models import tokenizer as tok
    from tests import tiny

    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return tok.from_hf_dir(path, [2])


def test_a_tool_call_quoting_its_prompt_in_a_json_string_drafts_from_the_escaped_view(chars):
    """The prompt holds a file; the answer quotes it inside a JSON string, where a newline
    is `\\n` and a quote `\\"`. The raw prompt matches only up to the line's end; the
    escaped view matches across lines, so the draft carries on through them."""
    prompt = chars.encode('def area(w, h):\n    return w * h  # "units"\n\nprint(area(2, 3))\n',
                          parse_special=False)
    view = escaped_view(chars, prompt)
    assert chars.decode(view) == 'def area(w, h):\\n    return w * h  # \\"units\\"\\n\\nprint(area(2, 3))\\n'
    answer = chars.encode('{"old": "def area(w, h):\\n    ret', parse_special=False)
    tokens = prompt + answer
    plain = SuffixDrafter().candidate(seq(0, tokens, len(prompt)))
    drafter = SuffixDrafter()
    drafter.add_view(seq(1, tokens, len(prompt)), view)
    got = drafter.candidate(seq(1, tokens, len(prompt)))
    assert chars.decode(got.tokens) == 'urn w * h  # \\"u'  # max_draft: 16 tokens, one per character
    assert not got.from_cache and got.match_len > plain.match_len
    assert '\\' not in chars.decode(plain.tokens)  # the raw prompt cannot write the escapes
    drafter.finish(seq(1, tokens, len(prompt)))  # the view goes with its sequence
    assert drafter.candidate(seq(1, tokens, len(prompt))).tokens == plain.tokens


def test_a_prompt_with_nothing_to_escape_or_too_long_gets_no_view(chars):
    assert escaped_view(chars, chars.encode("plain words only", parse_special=False)) is None
    long = chars.encode("a\n" * (MAX_VIEW_TOKENS // 2 + 1), parse_special=False)
    assert escaped_view(chars, long) is None
