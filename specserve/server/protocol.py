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

Every response, and the last chunk of every stream, carries `speculative_stats`.
Unknown fields are refused (400), as the OpenAI API does, so a typo never passes silently;
types are strict (no "1.5" for a number, no 1 for a bool).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling.params import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from specserve.speculative.config import MAX_SPECULATIVE_TOKENS

INT64 = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SpeculativeOptions(_Body):
    """Per-request speculation settings (all optional; the server's configuration fills the rest)."""

    enabled: bool = Field(True, description="false: plain target decoding for this request")
    num_speculative_tokens: Annotated[int, Field(ge=-1, le=MAX_SPECULATIVE_TOKENS)] | None = Field(
        None, description="a fixed draft length k for this request; -1: the cost-aware policy chooses")
    tv_budget: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="mentored decoding: total-variation budget D in [0, 1] (0 = lossless)")
    tv_entropy_top_k: Annotated[int, Field(ge=2)] | None = Field(
        None, description="spend the budget where the target is unsure: D_i = D * h_k(p_i)")
    fly_window: Annotated[int, Field(ge=1)] | None = Field(
        None, description="FLy verification: the later drafts that must pass (off when omitted)")
    fly_entropy_threshold: Annotated[float, Field(ge=0.0)] | None = Field(
        None, description="FLy: the top-k entropy at which a rejection may be deferred "
        "(normalized, in [0, 1]; for the published variant in nats, in [0, log fly_top_k])")
    fly_top_k: Annotated[int, Field(ge=2)] | None = Field(
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
    top_k: Annotated[int, Field(ge=-1)] = -1
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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1, max_length=16)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=16)]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the OpenAI default for completions


# ---------------------------------------------------------------------------- responses
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
                                          "backed_off")


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


class ChatResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


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
