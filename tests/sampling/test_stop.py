"""Tests for stop strings (`StopChecker`) and token-level stops (`finish_reason_for_token`)."""

from __future__ import annotations

import random

import pytest

from specserve.sampling.params import SamplingParams
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
