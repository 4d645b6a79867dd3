"""Tests for `SpeculativeConfig`: every bad value is a ValueError naming its field, raised at
construction, and every value that constructs is normalised to its declared type."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from specserve.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

NGRAM = {"method": "ngram"}
INVALID = [
    ("method", "medusa"),
    ("method", None),
    ("method", 1),
    ("model", ""),
    ("model", 3),
    ("num_speculative_tokens", 2.5),
    ("num_speculative_tokens", "4"),
    ("num_speculative_tokens", True),
    ("num_speculative_tokens", -2),
    ("num_speculative_tokens", MAX_SPECULATIVE_TOKENS + 1),
    ("tv_budget", "abc"),
    ("tv_budget", "0.5"),
    ("tv_budget", True),
    ("tv_budget", -0.1),
    ("tv_budget", 1.5),
    ("tv_budget", math.nan),
    ("bonus_token", "no"),
    ("bonus_token", 1),
    ("bonus_token", None),
    ("draft_policy", "fastest"),
    ("draft_policy", 3),
    ("max_k", 2.5),
    ("max_k", "8"),
    ("max_k", 0),
    ("max_k", MAX_SPECULATIVE_TOKENS + 1),
    ("max_k", False),
    ("prompt_lookup_max", 0),
    ("prompt_lookup_max", "4"),
    ("prompt_lookup_min", 0),
    ("prompt_lookup_min", 1.0),
    ("disable_by_batch_size", "2"),
    ("disable_by_batch_size", 0),
    ("disable_by_batch_size", 2.0),
    ("draft_dtype", "int3"),
    ("draft_dtype", 16),
    ("draft_weights", "int3"),
    ("draft_weights", 4),
    ("prefill_window", 0),
    ("prefill_window", 2.5),
    ("prefill_window", "256"),
    ("prefill_window", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig(**(NGRAM | {field: value}))
    assert str(error.value).startswith(field), str(error.value)


def test_lookup_min_above_max_is_caught_in_the_config():
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=4)


def test_draft_model_method_needs_a_model():
    with pytest.raises(ValueError, match="^model must name the draft model"):
        SpeculativeConfig(method="draft_model")


def test_valid_values_are_normalised_to_their_types():
    config = SpeculativeConfig(model=Path("/m/draft.gguf"), tv_budget=1, num_speculative_tokens=-1)
    assert config.model == "/m/draft.gguf" and isinstance(config.model, str)
    assert config.tv_budget == 1.0 and isinstance(config.tv_budget, float)
    assert config.policy_name == "cost_aware"


def test_boundaries_are_accepted():
    SpeculativeConfig(method="ngram", num_speculative_tokens=0, tv_budget=0, max_k=1,
                      prompt_lookup_min=3, prompt_lookup_max=3, disable_by_batch_size=1)
    SpeculativeConfig(method="ngram", num_speculative_tokens=MAX_SPECULATIVE_TOKENS, tv_budget=1.0,
                      max_k=MAX_SPECULATIVE_TOKENS, bonus_token=False, draft_dtype="float32")


def test_from_dict_rejects_unknown_fields_and_non_dicts():
    with pytest.raises(ValueError, match="unknown fields.*num_spec_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_spec_tokens": 4})
    with pytest.raises(ValueError, match="^speculative_config must be a dict"):
        SpeculativeConfig.from_dict("ngram")
    assert SpeculativeConfig.from_dict(None) is None
    config = SpeculativeConfig(method="ngram")
    assert SpeculativeConfig.from_dict(config) is config


def test_prefill_window_defaults_to_the_drafters_and_none_means_the_whole_context():
    from specserve.speculative.draft_model import DEFAULT_PREFILL_WINDOW

    assert SpeculativeConfig(**NGRAM).prefill_window == DEFAULT_PREFILL_WINDOW
    assert SpeculativeConfig(**NGRAM, prefill_window=None).prefill_window is None
    assert SpeculativeConfig(**NGRAM, prefill_window=64).prefill_window == 64
