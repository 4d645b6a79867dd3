"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names and meanings follow the OpenAI API (so the official client works unmodified),
plus vLLM's sampling extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`) and two of our own:

- `speculative`: per-request speculation. `false` turns it off for this request; an object
  `{"enabled": bool, "num_speculative_tokens": k, "tv_budget": D}` sets a fixed draft length
  (`-1` lets the cost-aware policy choose) and the mentored-decoding budget; it may also ask
  for the entropy-aware budget (`tv_entropy_top_k`) or FLy (`fly_window`,
  `fly_entropy_threshold`, `fly_top_k`, `fly_variant`), the `SamplingParams` fields of those
  names.
- `return_token_origins`: `true` adds `origins` (one of plain / accepted / recovered / bonus
  per token) to every choice and stream delta.

Agents' fields, in OpenAI's shapes: `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format`, assistant messages with `tool_calls` (content may be null) and `tool`
messages with `tool_call_id`; vLLM's `structured_outputs` (`json`, `regex`, `choice` or
`json_object`) on both endpoints. The response bodies are in `response_bodies.py`.
Unknown fields are refused (400), as the OpenAI API does, so a typo never passes silently;
types are strict (no "1.5" for a number, no 1 for a bool).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.sampling.params import (MAX_ENTROPY_TOP_K, MAX_LOGPROBS, MAX_STOP_CHARS,
                                       MAX_STOP_STRINGS, MAX_TOP_K)
from specserve.speculative.config import MAX_SPECULATIVE_TOKENS

INT64 = 2**63
MAX_TOOLS = 128  # OpenAI's bound


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SpeculativeOptions(_Body):
    """Per-request speculation settings (all optional; the server's configuration fills the rest)."""

    enabled: bool = Field(True, description="false: plain target decoding for this request")
    num_speculative_tokens: Annotated[int, Field(ge=-1, le=MAX_SPECULATIVE_TOKENS)] | None = Field(
        None, description="a fixed draft length k for this request; -1: the cost-aware policy chooses")
    tv_budget: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="mentored decoding: total-variation budget D in [0, 1] (0 = lossless)")
    tv_entropy_top_k: Annotated[int, Field(ge=2, le=MAX_ENTROPY_TOP_K)] | None = Field(
        None, description="spend the budget where the target is unsure: D_i = D * h_k(p_i)")
    fly_window: Annotated[int, Field(ge=1)] | None = Field(
        None, description="FLy verification: the later drafts that must pass (off when omitted)")
    fly_entropy_threshold: Annotated[float, Field(ge=0.0)] | None = Field(
        None, description="FLy: the top-k entropy at which a rejection may be deferred "
        "(normalized, in [0, 1]; for the published variant in nats, in [0, log fly_top_k])")
    fly_top_k: Annotated[int, Field(ge=2, le=MAX_ENTROPY_TOP_K)] | None = Field(
        None, description="FLy: the k of its top-k entropy gate")
    fly_variant: Literal["specserve", "published"] | None = Field(
        None, description="FLy: 'specserve' (ours) or 'published' (the authors' code; on by "
        "itself, fly_window its win_len, default 6)")


class StreamOptions(_Body):
    include_usage: bool = False


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopField = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
Seed = Annotated[int, Field(ge=-INT64, lt=INT64)]


class SamplingFields(_Body):
    """Fields shared by chat and text completions."""

    model: str = Field(description="the served model's name (see /v1/models)")
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stop: StopField = Field(None, description=f"up to {MAX_STOP_STRINGS} stop strings of up to "
                                               f"{MAX_STOP_CHARS} characters")
    seed: Seed | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100.0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    # ours
    speculative: bool | SpeculativeOptions | None = Field(
        None, description="per-request speculation: false (off), or {enabled, num_speculative_tokens, "
                          "tv_budget}; omitted: the server's configuration")
    return_token_origins: bool = Field(
        False, description="add `origins` (plain | accepted | recovered | bonus per token) to choices "
                           "and stream deltas")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: its calls")
    tool_call_id: str | None = Field(None, description="tool messages: the call this answers")

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages, and only they, carry tool_call_id")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing (only an assistant message with tool_calls "
                             "may have null content)")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments")
    strict: bool | None = Field(None, description="true: arguments are held to the schema")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Body):
    mode: Literal["auto", "required"] = Field(description="auto: the model may call one of "
                                                          "`tools`; required: it must")
    tools: Annotated[list[NamedToolChoice], Field(min_length=1, max_length=MAX_TOOLS)]


class AllowedToolsChoice(_Body):
    """OpenAI's `allowed_tools`: every tool is shown, calls are held to these."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Union[Literal["none", "auto", "required"],
                   Annotated[Union[NamedToolChoice, AllowedToolsChoice],
                             Field(discriminator="type")]]


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchema(_Body):
    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat],
                           Field(discriminator="type")]


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    json_object: bool | None = None
    model_config = ConfigDict(populate_by_name=True)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required", '
                          '{"type": "function", "function": {"name": ...}} or '
                          '{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1, max_length=16)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=16)]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the OpenAI default for completions
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
