"""Building chat requests and running them through the server's preparation."""

from __future__ import annotations

from specserve.server.limits import ServerLimits
from specserve.server.preparation import Job, ModelLimits, chat_jobs
from specserve.server.protocol import ChatCompletionRequest

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}


def request(messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def job(tokenizer, messages: list[dict], compiler=None, **fields) -> Job:
    limits = ModelLimits("m", 1 << 16, tokenizer.vocab_size, speculative=False)
    (only,) = chat_jobs(request(messages, **fields), tokenizer, limits, ServerLimits(),
                        compiler=compiler)
    return only


def prompt(tokenizer, messages: list[dict], **fields) -> str:
    """The prompt a request makes, its control tokens written out."""
    ids = job(tokenizer, messages, **fields).prompt_ids
    return tokenizer.decode(ids, skip_special_tokens=False)
