"""One completion of a request: its tokens, where it stands in the KV cache, and everything
the engine keeps for it — its output state (`out`), its speculation state (`spec`, the
controller's) and its grammar matcher (`grammar`) — created with it and dropped with it.

Invariant between engine steps, once prefilled: the target cache holds every token but the
last (`num_cached == len(token_ids) - 1`); the next pass feeds the last token (plus any draft).
While `num_cached < prefill_end` the sequence is prefilling: each step may feed it a chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from specserve.engine.block_manager import BlockTable
from specserve.sampling.params import SamplingParams
from specserve.speculative.metrics import SpecMetrics


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    tv_budget: float
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)  # its blocks in the target's KV cache
    num_cached: int = 0  # positions of the target's KV cache computed (see the module doc)
    prefix_hit: int = 0  # prompt positions the prefix cache gave when it was first admitted
    # positions to compute before the first round: the prompt (the last chunk's logits give
    # the first token) or, after a preemption, every token but the last (no sampling)
    prefill_end: int = 0
    finish_reason: str | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    out: object = None  # its output state (`output_processor.CompletionState`)
    spec: object = None  # the speculation controller's state of it (None: no speculation)
    grammar: object = None  # its grammar matcher when the request is constrained
    client: str | None = None  # whom the request serves (the scheduler shares slots by it)
    held: bool = False  # its reader is behind: not scheduled until released (the scheduler's)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.num_cached < self.prefill_end

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def tokens_left(self) -> int:
        limit = self.params.max_tokens
        return (limit - self.num_output) if limit is not None else 1 << 30
