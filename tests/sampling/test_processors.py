"""Tests for `processed_probs`: each stage on hand-made logits, and per-row penalty contexts."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specserve.sampling import processors
from specserve.sampling.params import SamplingParams
from specserve.sampling.processors import needs_history, processed_probs


def logits_of(*probabilities: float) -> torch.Tensor:
    """A `[1, V]` logits row whose softmax is `probabilities`."""
    return torch.tensor([probabilities]).log()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def run(logits: torch.Tensor, history=(), prompt_len: int = 0, draft=None, **kwargs):
    return processed_probs(logits, SamplingParams(**kwargs), list(history), prompt_len, draft)


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Row by row in Python: keep the most likely tokens until their mass reaches top_p."""
    out = torch.zeros_like(probs)
    for row, values in enumerate(probs.double().tolist()):
        order = sorted(range(len(values)), key=lambda i: -values[i])
        mass, chosen = 0.0, []
        for index in order:
            if mass >= top_p:
                break
            chosen.append(index)
            mass += values[index]
        for index in chosen:
            out[row, index] = values[index]
    return out / out.sum(dim=-1, keepdim=True)


def test_default_params_give_plain_softmax_in_float32():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = run(logits, draft=torch.tensor([1, 2]))
    assert probs.dtype == torch.float32 and probs.shape == (3, 11)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))


def test_temperature_divides_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    torch.testing.assert_close(run(logits, temperature=0.5), torch.softmax(logits / 0.5, -1))
    torch.testing.assert_close(run(logits, temperature=3.0), torch.softmax(logits / 3.0, -1))


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"top_k": 1}, {"temperature": 1e-8}])
def test_greedy_gives_one_hot_at_argmax(kwargs):
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 1.0, 6.0, 0.0]])
    probs = run(logits, draft=torch.tensor([0]), **kwargs)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(probs, expected, rtol=0, atol=0)


def test_greedy_ties_go_to_the_lowest_token_id():
    probs = run(torch.tensor([[1.0, 4.0, 2.0, 4.0, 4.0]]), temperature=0.0)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_rows_matches_torch_argmax_on_ties_nans_and_strided_rows(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 301), generator=g).to(dtype)  # many ties per row
    logits[5, 7] = logits[9, 300] = float("nan")
    logits[11] = float("-inf")
    logits[13, 2] = logits[13, 5] = float("inf")
    for view in (logits, logits[:, 1:], logits[::3], logits.t().contiguous().t()):
        assert processors.argmax_rows(view) == view.argmax(dim=-1).tolist()


def test_greedy_scores_are_the_logits_unless_a_penalty_moves_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, 1.0, 6.0, 0.0]])
    plain = SamplingParams(temperature=0.0)
    assert processors.greedy_scores(logits, plain, [1, 2], 0) is logits
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    scores = processors.greedy_scores(logits, penalised, [1, 2], 0, torch.tensor([0]))
    expected = processed_probs(logits, penalised, [1, 2], 0, torch.tensor([0]))
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)
    assert processors.argmax_rows(scores) == [3, 2] != processors.argmax_rows(logits) == [1, 2]


def test_top_k_one_is_one_hot_even_at_high_temperature():
    probs = run(torch.tensor([[0.3, 0.2, 0.9, 0.1]]), temperature=5.0, top_k=1)
    assert probs[0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_top_k_keeps_the_k_largest_and_renormalises():
    probs = run(logits_of(0.1, 0.4, 0.2, 0.3), top_k=2)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))


def test_top_k_keeps_ties_with_the_kth_logit():
    assert kept(run(logits_of(0.4, 0.2, 0.2, 0.1, 0.1), top_k=2)) == {0, 1, 2}


def test_top_k_larger_than_vocabulary_keeps_everything():
    logits = logits_of(0.5, 0.3, 0.2)
    torch.testing.assert_close(run(logits, top_k=10), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.3, {0}),
        (0.39, {0}),
        (0.41, {0, 1}),
        (0.65, {0, 1}),
        (0.75, {0, 1, 2}),
        (0.95, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    probs = run(logits_of(0.4, 0.3, 0.2, 0.1), top_p=top_p)
    assert kept(probs) == expected
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_ties_with_the_last_kept_token():
    # 0.5 then a tie at 0.125: mass 0.55 needs one of the tied tokens, so all stay.
    assert kept(run(logits_of(0.5, 0.125, 0.125, 0.125, 0.125), top_p=0.55)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_at_least_one_token_for_tiny_top_p():
    assert kept(run(logits_of(0.25, 0.75), top_p=1e-9)) == {1}


def test_top_p_that_underflows_in_float32_still_keeps_the_most_likely_token():
    # 5e-324 is a positive double but 0 in float32: no token's preceding mass is below it
    assert kept(run(logits_of(0.25, 0.75), top_p=5e-324)) == {1}


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = logits_of(0.4, 0.3, 0.2, 0.1)
    assert kept(run(logits, top_p=0.5)) == {0, 1}
    assert kept(run(logits, top_k=2, top_p=0.5)) == {0}  # 4/7 >= 0.5 after top-k


def test_top_p_after_top_k_keeps_ties_beyond_the_kth_token():
    # top-k 2 keeps the tie {1, 2}: 0.5, 0.25, 0.25; top-p 0.6 needs one of the tied tokens
    assert kept(run(logits_of(0.4, 0.2, 0.2, 0.1, 0.1), top_k=2, top_p=0.6)) == {0, 1, 2}


@pytest.mark.parametrize(("min_p", "expected"), [(0.3, {0, 1, 2}), (0.6, {0, 1}), (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, expected):
    probs = run(logits_of(0.4, 0.3, 0.2, 0.1), min_p=min_p)
    assert kept(probs) == expected
    total = sum(p for i, p in enumerate((0.4, 0.3, 0.2, 0.1)) if i in expected)
    torch.testing.assert_close(probs[0, 0], torch.tensor(0.4 / total))


def test_min_p_is_applied_after_top_p():
    # top-p 0.95 keeps all four; min-p then drops the tokens under 0.6 * 0.4.
    assert kept(run(logits_of(0.4, 0.3, 0.2, 0.1), top_p=0.95, min_p=0.6)) == {0, 1}
    # top-p 0.45 keeps {0, 1}; min-p 0.3 would keep {0, 1, 2} alone: the intersection wins.
    assert kept(run(logits_of(0.4, 0.3, 0.2, 0.1), top_p=0.45, min_p=0.3)) == {0, 1}


@pytest.mark.parametrize("spread", [0.05, 3.0])
def test_top_p_over_a_large_vocabulary_matches_a_full_sort(spread):
    # A flat distribution needs more than TOP_P_CANDIDATES tokens (the widening path); a
    # peaked one is covered by the first candidates.
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5000, generator=generator) * spread
    probs = run(logits, top_p=0.9, draft=torch.tensor([0]))
    expected = reference_top_p(torch.softmax(logits, -1), 0.9)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected.float())
    needed = int((expected[0] > 0).sum())
    assert (needed > processors.TOP_P_CANDIDATES) == (spread < 1)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    probs = run(logits, history=[0, 1], prompt_len=1, repetition_penalty=2.0)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[1.0, -2.0, 0.5, 1.0]]), -1))


def test_presence_and_frequency_penalties_subtract_per_output_token():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    probs = run(
        logits, history=[3, 1, 1, 2], prompt_len=1, frequency_penalty=0.5, presence_penalty=0.25
    )
    # token 1 appears twice in the output, token 2 once, token 3 only in the prompt.
    expected = torch.tensor([[1.0, 1.0 - 2 * 0.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]])
    torch.testing.assert_close(probs, torch.softmax(expected, -1))


def test_prompt_tokens_count_for_repetition_but_not_for_presence_or_frequency():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    prompt_only = [0, 0, 0]
    for field in ("presence_penalty", "frequency_penalty"):
        probs = run(logits, history=prompt_only, prompt_len=3, **{field: 1.5})
        torch.testing.assert_close(probs, torch.softmax(logits, -1))
        moved = run(logits, history=prompt_only, prompt_len=2, **{field: 1.5})
        assert moved[0, 0] < moved[0, 1]
    probs = run(logits, history=prompt_only, prompt_len=3, repetition_penalty=2.0)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[0.5, 1.0, 1.0]]), -1))


def test_negative_penalties_reward_repeated_tokens():
    probs = run(torch.zeros(1, 3), history=[2], prompt_len=0, presence_penalty=-1.0)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[0.0, 0.0, 1.0]]), -1))


ALL_STAGES = {
    "repetition_penalty": 1.3,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.4,
    "temperature": 0.8,
    "top_k": 8,
    "top_p": 0.9,
    "min_p": 0.02,
}


@pytest.mark.parametrize(
    "kwargs",
    [ALL_STAGES, {"frequency_penalty": 1.0}, {"temperature": 0.0, "repetition_penalty": 3.0}],
)
def test_row_i_sees_the_draft_tokens_before_it(kwargs):
    generator = torch.Generator().manual_seed(2)
    vocab, prompt = 12, [4, 5, 9]
    history = prompt + [1, 4, 1]
    draft = torch.tensor([1, 7, 5, 7, 11])  # repeats, a prompt token, a new token
    logits = torch.randn(len(draft) + 1, vocab, generator=generator)
    logits[torch.arange(1, 6), draft] += 4.0  # each row favours the token drafted before it
    params = SamplingParams(**kwargs)
    together = processed_probs(logits, params, history, len(prompt), draft)
    for row in range(logits.shape[0]):
        context = history + draft[:row].tolist()
        alone = processed_probs(logits[row : row + 1], params, context, len(prompt))
        torch.testing.assert_close(together[row : row + 1], alone, rtol=0, atol=1e-7)
    # the draft tokens did matter: every row scored with the history alone differs
    history_only = torch.cat(
        [processed_probs(logits[row : row + 1], params, history, len(prompt)) for row in range(6)]
    )
    assert not torch.allclose(together, history_only)


def reference_penalties(row: list[float], context: list[int], prompt_len: int, params) -> list:
    """The penalties written out token by token, straight from their definitions."""
    out = list(row)
    output = Counter(context[prompt_len:])
    for token in set(context):
        logit = out[token]
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            logit = logit / penalty if logit > 0 else logit * penalty
        if output[token]:
            logit -= params.frequency_penalty * output[token] + params.presence_penalty
        out[token] = logit
    return out


def test_penalties_over_a_long_history_match_the_token_by_token_definition():
    generator = torch.Generator().manual_seed(6)
    vocab, num_rows, prompt_len = 1000, 5, 700
    history = torch.randint(0, vocab, (2000,), generator=generator).tolist()
    draft = torch.randint(0, vocab, (num_rows - 1,), generator=generator)
    draft[1] = draft[0]  # a repeated draft token
    logits = torch.randn(num_rows, vocab, generator=generator) * 3
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=-0.4)
    probs = processed_probs(logits, params, history, prompt_len, draft)
    for row in range(num_rows):
        context = history + draft[:row].tolist()
        expected = reference_penalties(logits[row].tolist(), context, prompt_len, params)
        torch.testing.assert_close(probs[row], torch.softmax(torch.tensor(expected), -1))


def test_penalties_with_an_empty_context_change_nothing():
    logits = torch.randn(1, 7, generator=torch.Generator().manual_seed(7))
    probs = run(logits, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_draft_tokens_beyond_the_last_row_are_ignored():
    logits = torch.zeros(2, 6)
    params = SamplingParams(frequency_penalty=1.0)
    long_draft = processed_probs(logits, params, [0], 0, torch.tensor([1, 2, 3, 4]))
    short_draft = processed_probs(logits, params, [0], 0, torch.tensor([1]))
    torch.testing.assert_close(long_draft, short_draft, rtol=0, atol=0)


def test_history_as_tensor_equals_history_as_list():
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(**ALL_STAGES)
    history = [1, 2, 2, 8, 0]
    draft = torch.tensor([2, 3])
    from_list = processed_probs(logits, params, history, 2, draft)
    from_tensor = processed_probs(logits, params, torch.tensor(history), 2, draft)
    torch.testing.assert_close(from_list, from_tensor, rtol=0, atol=0)


class Untouchable:
    """A history that fails the test if anything reads it."""

    def __len__(self):
        raise AssertionError("history was read although no penalty is set")

    def __iter__(self):
        raise AssertionError("history was read although no penalty is set")


def test_history_is_not_read_when_no_penalty_is_set():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    assert not needs_history(params)
    probs = processed_probs(torch.randn(2, 20), params, Untouchable(), 0, Untouchable())
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"temperature": 0.0, "top_p": 0.5}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"presence_penalty": -0.5}, True),
        ({"frequency_penalty": 0.1}, True),
    ],
)
def test_needs_history_only_for_penalties(kwargs, expected):
    assert needs_history(SamplingParams(**kwargs)) is expected


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    processed_probs(logits, SamplingParams(**ALL_STAGES), [1, 2, 3], 1, torch.tensor([5]))
    processed_probs(logits, SamplingParams(temperature=0.0), [], 0, torch.tensor([5]))
    assert torch.equal(logits, before)


def test_bfloat16_logits_give_float32_probabilities_summing_to_one():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5)).bfloat16()
    probs = run(logits, draft=torch.tensor([1, 2, 3]), temperature=0.6, top_p=0.8)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert math.isclose(float(probs.min()), 0.0) and bool((probs >= 0).all())
