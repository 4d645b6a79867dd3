"""Plain (target-only) generation through the public API on a tiny random model."""

from __future__ import annotations

import pytest

from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests import tiny

PROMPT = [5, 17, 33, 8]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=3), tmp_path_factory.mktemp("m"))
    return LLM(load_model(path, "float32"))


def tokens(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, **kw))[0].token_ids


def test_top_k_one_equals_greedy(llm):
    assert tokens(llm, temperature=1.0, top_k=1, seed=5) == tokens(llm, temperature=0.0)


def test_same_seed_same_tokens_and_different_seeds_differ(llm):
    a = tokens(llm, temperature=1.0, seed=1)
    assert a == tokens(llm, temperature=1.0, seed=1)
    assert a != tokens(llm, temperature=1.0, seed=2)


def test_n_completions_use_distinct_seeds(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_max_tokens_finishes_with_length_and_counts(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True, temperature=0))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and c.num_output_tokens == 7 and out.num_prompt_tokens == 4
    assert c.ttft is not None and c.ttft >= 0 and c.decode_time is not None


def test_stop_string_ends_text_before_it(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0))[0].text
    stop = full[5:8]
    assert len(stop) == 3
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True))[0]
    lp = out.outputs[0].logprobs
    assert len(lp) == 5
    for token, entry in zip(out.token_ids, lp):
        assert token in entry and entry[token] <= 0 and max(entry.values()) == entry[token]


def test_invalid_parameter_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_bad_speculative_config_names_the_field(llm):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(llm.target, speculative_config={"method": "ngram", "num_speculative_tokens": 99})
    with pytest.raises(ValueError, match="unknown fields"):
        LLM(llm.target, speculative_config={"method": "ngram", "k": 2})
