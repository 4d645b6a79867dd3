"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.spec.metrics import SpecMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    num_output_tokens: int
    ttft: float | None  # seconds from arrival to the first token
    decode_time: float | None  # seconds from the first token to the last
    e2e_time: float | None
    spec: SpecMetrics | None = None  # None for target-only decoding
    logprobs: list[dict[int, float]] | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        if not self.decode_time or self.num_output_tokens < 2:
            return None
        return (self.num_output_tokens - 1) / self.decode_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    # the first completion, for the common n = 1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
