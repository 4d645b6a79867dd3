"""Tests for `specserve.inputs` and the checks the Python API runs before any model loads or
any request is queued: the LLM constructor's arguments, prompts, sampling params and chat
messages (roles, content parts, lone surrogates)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import llm as llm_module
from specserve.inputs import check_conversations, check_generate_inputs, check_llm_args
from specserve.llm import LLM
from specserve.models import tokenizer as tok
from specserve.sampling.params import SamplingParams
from tests import tiny

MISSING_MODEL = "/nonexistent/specserve-test-model"
BAD_LLM_ARGS = [
    ({"dtype": "int3"}, "dtype"),
    ({"dtype": torch.int8}, "dtype"),
    ({"weights": "int2"}, "weights"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"max_num_seqs": 2.0}, "max_num_seqs"),
    ({"max_model_len": "4096"}, "max_model_len"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"draft": "qwen2.5-coder-0.5b"}, "draft"),
    ({"speculative_config": "ngram"}, "speculative_config"),
    ({"speculative_config": {"method": "ngram", "max_k": 2.5}}, "max_k"),
    ({"speculative_config": {"method": "ngram", "max_k": "8"}}, "max_k"),
    ({"speculative_config": {"method": "ngram", "disable_by_batch_size": "2"}}, "disable_by_batch_size"),
    ({"speculative_config": {"method": "ngram", "tv_budget": "abc"}}, "tv_budget"),
    ({"speculative_config": {"method": "ngram", "bonus_token": "no"}}, "bonus_token"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}},
     "prompt_lookup_min"),
    ({"speculative_config": {"method": "draft_model"}}, "model"),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load a model fails the test: validation must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were validated")

    monkeypatch.setattr(llm_module, "load_model", refuse)


@pytest.mark.parametrize(("kwargs", "field"), BAD_LLM_ARGS, ids=[f for _, f in BAD_LLM_ARGS])
def test_llm_constructor_names_the_bad_field_before_loading_anything(kwargs, field, no_loading):
    with pytest.raises(ValueError) as error:
        LLM(MISSING_MODEL, **kwargs)
    assert str(error.value).startswith(field), str(error.value)


def test_field_error_comes_before_the_missing_model_error():
    """No monkeypatching: the model path does not exist, yet the field is what is reported."""
    with pytest.raises(ValueError, match="^max_k must be an integer, got 2.5"):
        LLM(MISSING_MODEL, speculative_config={"method": "ngram", "max_k": 2.5})
    with pytest.raises(ValueError, match="^weights must be one of"):
        LLM(MISSING_MODEL, weights="int2")


def test_llm_model_argument_must_be_a_name_path_or_loaded_model(no_loading):
    for model in (None, 3, "", b"qwen"):
        with pytest.raises(ValueError, match="^model must be"):
            LLM(model)


def test_valid_llm_args_return_the_speculative_config():
    spec = check_llm_args("m", torch.float32, {"method": "ngram", "num_speculative_tokens": 3},
                          max_num_seqs=2, max_model_len=64, draft=None, weights="int4")
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert check_llm_args("m", "bf16", None, 1, 2, None, "bf16") is None


# ---- prompts and sampling params ---------------------------------------------------------

BAD_PROMPTS = [
    (b"the cat", "prompts must be a string"),
    ([True, False], r"prompt\[0\] must be an int token id"),
    ([1, 2.0], r"prompt\[1\] must be an int token id"),
    ([[1, 2], [3, True]], r"prompts\[1\]\[1\] must be an int token id"),
    ([b"a", b"b"], r"prompt\[0\] must be an int token id"),
    ([1, -1], r"prompt\[1\] must be a token id >= 0"),
    ((1, 2), "prompts must be a string"),
    (np.array([1, 2]), "prompts must be a string"),
    ([], "prompts is empty"),
    ([[]], r"prompts\[0\] is an empty list"),
    (None, "prompts must be a string"),
    ("ab\ud800cd", r"prompt contains a lone surrogate '\\ud800' at index 2"),
    (["ok", "\udcff"], r"prompts\[1\] contains a lone surrogate"),
]


@pytest.mark.parametrize(("prompts", "message"), BAD_PROMPTS, ids=[repr(p)[:30] for p, _ in BAD_PROMPTS])
def test_bad_prompts_are_refused_with_a_clear_error(prompts, message):
    with pytest.raises(ValueError, match=message):
        check_generate_inputs(prompts, None)


def test_prompts_come_back_as_a_batch_of_strings_and_plain_int_lists():
    params = SamplingParams(max_tokens=3)
    assert check_generate_inputs("hi", params) == (["hi"], [params])
    batch, ps = check_generate_inputs([np.int64(5), 6], None)
    assert batch == [[5, 6]] and type(batch[0][0]) is int and ps == [SamplingParams()]
    batch, _ = check_generate_inputs(["a", [1, 2], "b"], [params] * 3)
    assert batch == ["a", [1, 2], "b"]


def test_sampling_params_must_match_the_prompts():
    with pytest.raises(ValueError, match="got 1 for 2 prompts"):
        check_generate_inputs(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams"):
        check_generate_inputs(["a", "b"], [SamplingParams(), {"temperature": 0}])
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        check_generate_inputs("a", {"temperature": 0})


def test_conversations_are_one_or_a_list_never_a_mix():
    one = [{"role": "user", "content": "hi"}]
    assert check_conversations(one) == [one]
    assert check_conversations([one, one]) == [one, one]
    for bad in ([], "hi", [one[0], one], None):
        with pytest.raises(ValueError, match="^messages must be"):
            check_conversations(bad)


# ---- chat messages and the tokenizer ------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return tok.from_hf_dir(path, [2])


BAD_MESSAGES = [
    ([{"content": "hi"}], r"messages\[0\].role is missing"),
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\].role must be one of system, user, assistant"),
    ([{"role": "tool", "content": "42"}], r"role must be one of .* got 'tool'"),
    ([{"role": "user", "content": 42}], r"messages\[0\].content must be a string or"),
    ([{"role": "user"}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": None}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"content\[0\] must be \{'type': 'text'"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\].text must be a string"),
    ([{"role": "user", "content": []}], "non-empty list of text parts"),
    ([{"role": "user", "content": "hi", "contnet": "x"}], r"unknown keys \['contnet'\]"),
    ([{"role": "user", "content": "a\ud800"}], r"messages\[0\].content contains a lone surrogate"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([], "messages must be a non-empty list"),
]


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES, ids=[repr(m)[:40] for m, _ in BAD_MESSAGES])
def test_bad_chat_messages_are_refused_before_the_template_runs(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def test_text_content_parts_are_joined_and_rendered(tokenizer):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": parts}]) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "hello\nworld"}])


def test_tool_role_is_allowed_when_the_template_knows_it(tokenizer):
    import dataclasses

    template = tokenizer.chat_template + "{% if messages[-1]['role'] == 'tool' %}(tool){% endif %}"
    with_tools = dataclasses.replace(tokenizer, chat_template=template)
    assert with_tools.chat_roles == ("system", "user", "assistant", "tool")
    assert "(tool)" in with_tools.apply_chat_template([{"role": "tool", "content": "42"}])
    assert tokenizer.chat_roles == ("system", "user", "assistant")


def test_an_error_the_template_raises_is_a_value_error(tokenizer):
    import dataclasses

    strict = dataclasses.replace(tokenizer, chat_template=(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ messages[0]['content'] }}"))
    with pytest.raises(ValueError, match="chat template refused them: System role not supported"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_lone_surrogate_in_encode_is_a_clear_value_error(tokenizer):
    with pytest.raises(ValueError, match=r"text contains a lone surrogate '\\udc80' at index 3"):
        tokenizer.encode("abc\udc80")
    assert tokenizer.encode("abc é") == tokenizer.encode("abc é")  # valid non-ASCII is fine


# ---- on a tiny model: the call fails, nothing is queued, the next call works ---------------

@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from specserve.weights.loader import load_model

    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path_factory.mktemp("m"))
    return LLM(load_model(path, "float32"), max_num_seqs=2, max_model_len=128)


BAD_CALLS = [
    ("generate", (["the cat", b"the dog"],), "prompt"),
    ("generate", ([[5, 6], [True, 7]],), r"prompts\[1\]\[0\]"),
    ("generate", (["the cat", "a\ud800"],), "lone surrogate"),
    ("chat", ([[{"role": "user", "content": "hi"}], [{"role": "wizard", "content": "x"}]],), "role"),
    ("chat", ([{"role": "user", "content": 7}],), "content"),
]


@pytest.mark.parametrize(("method", "args", "message"), BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_input_queues_nothing_and_the_next_call_works(tiny_llm, method, args, message):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = tiny_llm.generate("the cat", greedy)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        getattr(tiny_llm, method)(*args, greedy)
    assert not tiny_llm.engine.has_unfinished()
    assert tiny_llm.generate("the cat", greedy)[0].outputs[0].token_ids == expected
