"""One request as the engine core holds it: what was asked, and its sequences (one per
completion, each carrying its own output, speculation and grammar state).

The engine keeps exactly one table, request id → `Request`, from `add_request` until the
request's final delta is handed out; everything else about a request hangs off this record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.outputs import SpeculationOverride
from specserve.engine.sequence import Sequence
from specserve.sampling.params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None  # the prompt's text, when it came as text
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    speculation: SpeculationOverride | None = None
    grammar: object = None  # a compiled grammar (`sampling.grammar.Grammar`) or None
    client: str | None = None  # whom it serves (slots are shared among clients)
    seqs: list[Sequence] = field(default_factory=list)  # [n]
    error: BaseException | None = None  # why it failed in the engine, if it did

    @property
    def finished(self) -> bool:
        """Every completion has its finish reason (a request refused at once has none)."""
        return all(s.out.finish_reason is not None for s in self.seqs)
