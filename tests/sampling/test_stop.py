"""Tests for stop strings (`StopChecker`) and token-level stops (`finish_reason_for_token`)."""

from __future__ import annotations

import random

import pytest

from specserve.sampling.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from specserve.sampling.stop import StopChecker, finish_reason_for_token


def excluding(*stop: str) -> StopChecker:
    return StopChecker(stop, include_stop_str_in_output=False)


def including(*stop: str) -> StopChecker:
    return StopChecker(stop, include_stop_str_in_output=True)


def stream(checker: StopChecker, chunks: list[str]) -> tuple[str, str, bool]:
    """Feed chunks like the engine does: (text streamed before the end, final text, stopped)."""
    text, streamed = "", ""
    for chunk in chunks:
        start = len(text)
        text += chunk
        cut = checker.check(text, start)
        if cut is not None:
            return streamed, text[:cut], True
        visible = text[: len(text) - checker.held_back(text)]
        assert visible.startswith(streamed), "streamed text must only grow"
        streamed = visible
    return streamed, text, False


def test_stop_string_inside_one_chunk_cuts_before_it():
    assert excluding("wor").check("hello world", 0) == 6


def test_include_stop_str_in_output_cuts_after_it():
    assert including("wor").check("hello world", 0) == 9


def test_stop_string_spanning_the_previous_and_the_new_chunk_is_found():
    # "hello wo" was checked before; "rld" just arrived
    assert excluding("world").check("hello world", 8) == 6
    assert including("world").check("hello world", 8) == 11


def test_stop_string_spanning_many_one_character_chunks_is_found():
    streamed, final, stopped = stream(excluding("<|end|>"), list("abc<|end|>def"))
    assert stopped and final == "abc" and streamed == "abc"


def test_search_starts_only_one_stop_length_before_the_new_text():
    # "stop" is text[3:7]: from 7 on it lies wholly in old text that was checked already
    checker = excluding("stop")
    assert checker.check("ab stop xyz", 7) is None
    assert checker.check("ab stop xyz", 6) == 3  # "p" is new: the match ends in the new text


def test_no_stop_string_gives_none():
    assert excluding("zz").check("hello world", 0) is None
    assert StopChecker((), False).check("anything", 0) is None
    assert StopChecker((), False).held_back("anything") == 0


def test_the_stop_string_completed_first_wins():
    # "bc" is complete after "abc", before "abcd" is: streaming char by char agrees
    checker = excluding("abcd", "bc")
    assert checker.check("xabcd", 0) == 2
    assert stream(checker, list("xabcd"))[1] == "xa"
    assert including("abcd", "bc").check("xabcd", 0) == 4


def test_stop_strings_completed_together_prefer_the_longer():
    assert excluding("bc", "abc").check("xabc", 0) == 1
    assert excluding("abc", "bc").check("xabc", 0) == 1


def test_first_occurrence_of_a_repeated_stop_string_wins():
    assert excluding("\n").check("a\nb\nc", 0) == 1


@pytest.mark.parametrize(
    ("stops", "text", "held"),
    [
        (("world",), "hello wo", 2),
        (("world",), "hello w", 1),
        (("world",), "hello", 0),
        (("world",), "worl", 4),
        (("abc",), "abab", 2),
        (("xyz", "yz!"), "..xy", 2),
        (("xyz", "yz!"), "..xyz", 2),  # "yz" may still become "yz!"
        (("xyz",), "..xyz", 0),  # a full match is check's business, not held back
        (("abcd", "d"), "abc", 3),
        (("",) * 0, "abc", 0),
    ],
)
def test_held_back_is_the_longest_tail_that_starts_a_stop_string(stops, text, held):
    assert excluding(*stops).held_back(text) == held


def test_held_back_text_is_released_when_the_stop_string_does_not_follow():
    streamed, final, stopped = stream(excluding("world"), ["hello wo", "rm!"])
    assert not stopped and final == "hello worm!" and streamed == "hello worm!"
    checker = excluding("world")
    assert checker.held_back("hello wo") == 2  # "wo" withheld after the first chunk


@pytest.mark.parametrize("include", [False, True])
def test_output_does_not_depend_on_how_text_is_chunked(include):
    text = "def f():\n    return 1\n\n\nclass A:\n    pass\n"
    checker = StopChecker(("\n\n\n", "class", "\nreturn"), include)
    expected = "def f():\n    return 1\n\n\n" if include else "def f():\n    return 1"
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        streamed, final, stopped = stream(checker, chunks)
        assert stopped and final == expected, chunks
        assert expected.startswith(streamed) and "\n\n\n" not in streamed


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="^stop"):
        StopChecker(("ok", ""), False)


def test_from_params_uses_the_request_stop_settings():
    checker = StopChecker.from_params(
        SamplingParams(stop=["END"], include_stop_str_in_output=True)
    )
    assert checker.check("abEND", 0) == 5


EOS = frozenset({2, 7})


@pytest.mark.parametrize(
    ("token", "kwargs", "reason"),
    [
        (2, {}, "stop"),
        (7, {}, "stop"),
        (2, {"ignore_eos": True}, None),
        (5, {"stop_token_ids": [5]}, "stop"),
        (5, {"stop_token_ids": [5], "ignore_eos": True}, "stop"),
        (5, {}, None),
        (3, {"stop_token_ids": [5]}, None),
    ],
)
def test_finish_reason_for_token(token, kwargs, reason):
    assert finish_reason_for_token(token, SamplingParams(**kwargs), EOS) == reason


def comparisons_per_character(stop: tuple[str, ...], text: str, chunk: int) -> float:
    checker = excluding(*stop)
    stream(checker, [text[i:i + chunk] for i in range(0, len(text), chunk)])
    return checker.comparisons / len(text)


@pytest.mark.parametrize("chunk", [1, 7])
def test_work_per_new_character_does_not_grow_with_the_stop_strings_length(chunk):
    # text that keeps almost matching: every stop string is "a" * L + "b", the text all "a"
    text = "a" * 3000
    short = comparisons_per_character(("a" * 3 + "b",) * 4, text, chunk)
    long = comparisons_per_character(("a" * 255 + "b",) * 4, text, chunk)
    # each matcher does amortized < 2 comparisons per character, whatever the length
    assert short <= 2 * 4 and long <= 2 * 4


def test_a_stream_withholds_the_almost_matched_tail_of_a_long_stop_string():
    stop = "x" * 200 + "!"
    streamed, final, stopped = stream(excluding(stop), ["ab", *["x"] * 200, "!tail"])
    assert stopped and final == "ab" and streamed == "ab"
    streamed, final, stopped = stream(excluding(stop), ["ab", *["x"] * 150, "y"])
    assert not stopped and streamed == final == "ab" + "x" * 150 + "y"


def test_matches_agree_with_a_plain_search_on_random_text():
    rng = random.Random(1)
    for _ in range(300):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                      for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 20)))
        ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        expected = min(ends)[0] + min(ends)[1] if ends else None
        assert stream(excluding(*stops), list(text))[1] == (text[:expected] if ends else text)
        assert excluding(*stops).check(text, 0) == expected


def test_too_many_or_too_long_stop_strings_are_refused():
    with pytest.raises(ValueError, match="^stop takes at most"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="^stop entries must be at most"):
        SamplingParams(stop=["s" * (MAX_STOP_CHARS + 1)])
    assert SamplingParams(stop=["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).stop[0] == "s" * 256
