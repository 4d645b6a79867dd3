"""Tests for `SamplingParams`: defaults, normalisation, and one ValueError per bad value."""

from __future__ import annotations

import dataclasses
import math

import pytest

from specserve.sampling.params import SamplingParams

INVALID = [
    ("n", 0),
    ("n", 1.0),
    ("n", True),
    ("temperature", -1),
    ("temperature", -1e-9),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "0.7"),
    ("temperature", True),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", None),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("seed", 2**63),
    ("seed", 2**70),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2.0),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop", ["ok", "a\ud800"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("ignore_eos", "no"),
    ("include_stop_str_in_output", 0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("tv_budget", -0.1),
    ("tv_budget", 1.1),
    ("tv_budget", math.nan),
    ("tv_budget", "half"),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(field + " "), str(error.value)


def test_defaults_follow_vllm_and_openai():
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_k == -1
    assert params.top_p == 1.0
    assert params.min_p == 0.0
    assert params.repetition_penalty == 1.0
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
    assert params.seed is None
    assert params.max_tokens == 16
    assert params.stop == () and params.stop_token_ids == ()
    assert params.ignore_eos is False and params.include_stop_str_in_output is False
    assert params.logprobs is None and params.tv_budget is None
    assert not params.greedy


BOUNDARIES = [
    ("temperature", 0),
    ("top_k", 1),
    ("top_p", 1),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 1e-3),
    ("presence_penalty", -2.0),
    ("frequency_penalty", 2),
    ("seed", -3),
    ("seed", 2**63 - 1),
    ("seed", -(2**63)),
    ("max_tokens", None),
    ("max_tokens", 1),
    ("logprobs", 0),
    ("logprobs", 20),
    ("tv_budget", 0),
    ("tv_budget", 1.0),
]


@pytest.mark.parametrize(("field", "value"), BOUNDARIES, ids=[f"{f}={v!r}" for f, v in BOUNDARIES])
def test_boundary_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_int_given_for_float_field_is_stored_as_float():
    params = SamplingParams(temperature=1, top_p=1, tv_budget=0, presence_penalty=2)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert isinstance(params.tv_budget, float) and isinstance(params.presence_penalty, float)


def test_every_accepted_seed_seeds_the_engines_generator():
    """The engine seeds completion i with `seed + i` (torch.Generator.manual_seed): no seed
    that passes validation may fail there ("Overflow when unpacking long long")."""
    import torch

    for seed in (-(2**63), -1, 0, 2**63 - 1):
        params = SamplingParams(seed=seed, n=4)
        for i in range(params.n):
            torch.Generator().manual_seed(params.seed + i)


def test_numpy_ints_are_stored_as_python_ints():
    import numpy as np

    params = SamplingParams(n=np.int64(2), seed=np.int64(7), max_tokens=np.int32(5))
    assert type(params.n) is int and type(params.seed) is int and type(params.max_tokens) is int


def test_top_k_zero_is_normalised_to_disabled():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)


def test_stop_accepts_a_string_a_list_or_none_and_stores_a_tuple():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_normalised_params_are_hashable_and_frozen():
    params = SamplingParams(stop=["x"], stop_token_ids=[1])
    assert hash(params) == hash(SamplingParams(stop=("x",), stop_token_ids=(1,)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-7}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"top_k": 2}, False),
        ({"top_p": 1e-6}, False),
    ],
)
def test_greedy_means_temperature_zero_or_top_k_one(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy
