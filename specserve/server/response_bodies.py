"""Response bodies of the OpenAI-compatible API, as pydantic models (for the OpenAPI schema;
the routes build plain dicts of these shapes, see `responses.py`).

A chat message holds `content` (null when the message is only tool calls) and `tool_calls`,
each `{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments"}}` with
the arguments a JSON text, as OpenAI writes them; such a choice ends with `finish_reason`
"tool_calls". Every response, and the last chunk of every stream, carries
`speculative_stats`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SourceStats(_Out):
    """What one drafting source contributed to a request."""

    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float | None


class SpeculativeStats(_Out):
    """One request's speculative decoding, summed over its `n` completions."""

    enabled: bool = Field(description="whether this request was allowed to speculate")
    rounds: int = Field(description="decoding rounds (plain decoding steps count as rounds with k = 0)")
    drafted: int = Field(description="draft tokens proposed")
    accepted: int = Field(description="draft tokens the target kept")
    emitted: int = Field(description="tokens emitted by the rounds (accepted + recovered or bonus)")
    acceptance_rate: float | None = Field(description="accepted / drafted")
    mean_acceptance_length: float | None = Field(description="tokens emitted per round, bonus included")
    realised_tv: float | None = Field(description="mean total variation TV(pi, p) actually spent per "
                                                  "verified draft position (0 when lossless)")
    per_position_acceptance: list[float] = Field(default_factory=list)
    by_source: dict[str, SourceStats] = Field(
        default_factory=dict, description="per drafting source (suffix, ngram, draft_model): "
                                          "rounds it drafted, tokens drafted and accepted")
    idle_rounds: dict[str, int] = Field(
        default_factory=dict, description="rounds that drafted nothing, by reason: off, no_room, "
                                          "no_match, did_not_pay, batch_limit, draft_starting, "
                                          "backed_off, probe")


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


class FunctionCallOut(_Out):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the message is only tool calls")
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: dict | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative_stats: SpeculativeStats | None = None


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative_stats: SpeculativeStats | None = None
