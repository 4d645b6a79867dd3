"""Request bodies: OpenAI field names, strict types, ranges, unknown fields refused."""

import pytest
from pydantic import ValidationError

from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, SpeculativeOptions

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_accepts_openai_and_vllm_fields():
    req = ChatCompletionRequest.model_validate({
        **CHAT, "n": 2, "stop": ["\n"], "seed": 7, "max_completion_tokens": 5, "temperature": 0,
        "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": True,
        "top_logprobs": 3, "user": "u", "stream": True, "stream_options": {"include_usage": True},
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
        "stop_token_ids": [2], "speculative": {"enabled": True, "num_speculative_tokens": 3,
                                               "tv_budget": 0.2},
        "return_token_origins": True})
    assert req.temperature == 0.0 and req.speculative.num_speculative_tokens == 3


def test_chat_content_may_be_text_parts():
    req = ChatCompletionRequest.model_validate(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "ab"


@pytest.mark.parametrize("field,value", [
    ("temperature", "0.5"), ("temperature", True), ("n", 1.0), ("n", 0), ("top_p", 0), ("top_p", 1.5),
    ("max_tokens", 0), ("stream", "yes"), ("presence_penalty", 3), ("seed", 2**64), ("top_k", -2),
    ("messages", []), ("top_logprobs", 21), ("frequency_penalty", float("nan")), ("tools", []),
    ("speculative", {"num_speculative_tokens": 99}), ("speculative", {"tv_budget": 2}),
    ("speculative", "off"), ("stop_token_ids", [-1])])
def test_chat_refuses_wrong_types_ranges_and_unknown_fields(field, value):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, field: value})
    assert info.value.errors()[0]["loc"][0] == field


def test_completion_prompt_forms_and_default_max_tokens():
    for prompt in ["text", [1, 2, 3], ["a", "b"], [[1, 2], [3]]]:
        req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        assert req.max_tokens == 16
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": []})


def test_speculative_false_or_object():
    assert ChatCompletionRequest.model_validate({**CHAT, "speculative": False}).speculative is False
    assert SpeculativeOptions().enabled is True
