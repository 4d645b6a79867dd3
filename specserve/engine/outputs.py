"""What the engine hands back: per-step deltas while a request runs, and its final output.

A request's completions stream as `CompletionDelta`s (new token ids, new text, logprobs, the
origin of each token) grouped per engine step in a `RequestDelta`; the last delta of a request
carries its full `RequestOutput`. Concatenating a completion's delta texts (or token ids)
gives exactly its final text (or token ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.speculative.metrics import SpecMetrics
from specserve.speculative.config import check_num_speculative_tokens


class TokenOrigin:
    """Why a token was emitted (strings, so they serialize as they are).

    A speculative round with k drafts emits the drafts the verifier *accepted*, then either the
    target's *recovered* token for the first rejected draft or, when all k were accepted, a
    *bonus* token sampled from the last position; a round with k = 0 emits one *plain* token.
    """

    PLAIN = "plain"
    ACCEPTED = "accepted"
    RECOVERED = "recovered"
    BONUS = "bonus"

    @staticmethod
    def of_round(num_tokens: int, k: int, num_accepted: int) -> list[str]:
        """The origins of a round's first `num_tokens` tokens (drafts `k`, `num_accepted` kept)."""
        if k == 0:
            last = TokenOrigin.PLAIN
        else:
            last = TokenOrigin.BONUS if num_accepted == k else TokenOrigin.RECOVERED
        origins = [TokenOrigin.ACCEPTED] * num_accepted + [last]
        return origins[:num_tokens]


@dataclass(frozen=True, slots=True)
class SpeculationOverride:
    """Per-request speculation settings. E.g. `SpeculationOverride(enabled=False)` decodes one
    request plainly in a speculative engine; `num_speculative_tokens=2` fixes its k (-1 =
    cost-aware); `tv_budget` replaces the engine's mentored-verification budget."""

    enabled: bool = True
    num_speculative_tokens: int | None = None
    tv_budget: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"speculation.enabled must be a bool, got {self.enabled!r}")
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens("speculation.num_speculative_tokens",
                                         self.num_speculative_tokens)
        tv = self.tv_budget
        if tv is not None and (isinstance(tv, bool) or not isinstance(tv, (int, float))
                               or not 0.0 <= tv <= 1.0):
            raise ValueError(f"speculation.tv_budget must be a number in [0, 1], got {tv!r}")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_output_tokens: int
    ttft: float | None  # seconds from arrival to the first token
    decode_time: float | None  # seconds from the first token to the last
    e2e_time: float | None
    spec: SpecMetrics | None = None  # None for target-only decoding
    logprobs: list[dict[int, float]] | None = None
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    origins: list[str] | None = None  # one TokenOrigin per output token
    # vLLM's: the stop string or stop token id that ended it (None: EOS, length, abort)
    stop_reason: str | int | None = None

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
    queue_time: float | None = None  # seconds from arrival to its first completion's scheduling
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's name)

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


@dataclass
class CompletionDelta:
    """What completion `index` of a request gained in one engine step."""

    index: int
    token_ids: list[int]  # new token ids (after stop-string truncation)
    text: str  # new text; a possible stop string's start is held back until it cannot match
    logprobs: list[dict[int, float]] | None  # one dict per new token when requested
    origins: list[str]  # one TokenOrigin per new token
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"


@dataclass
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta]  # only the completions that advanced in this step
    finished: bool  # every completion of the request has finished
    output: RequestOutput | None  # the full output (with metrics) when finished
    error: BaseException | None = None  # set when the request failed inside the engine


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for a server's /metrics and /health."""

    running: int
    waiting: int
    kv_usage: float  # 0..1 of the KV budget
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    aborted: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    spec: SpecMetrics  # engine-wide totals
    rolling_acceptance: float | None
    healthy: bool  # rolling acceptance >= 0.6 (or nothing drafted yet)
    kv_touched_bytes: int = 0  # KV pool bytes ever taken (resident), at most the budget
    held: int = 0  # sequences held because their readers are behind (counted in running/waiting)
    # (part, on oneDNN) for each projection and "attention" of the prefill path's choice
    prefill_onednn: tuple[tuple[str, bool], ...] = ()
    prefill_dense_bytes: int = 0  # bytes of its dense (bf16) weights beside the int4 ones
