"""The drafter protocols: propose → verify → commit.

Two kinds of source serve the speculation controller (`controller.py`):
- a *lookup* (`LookupSource`: suffix drafting, prompt lookup) searches text it already has;
  it offers a candidate continuation before the step (`candidate`, with a confidence per
  position), costs nothing to run, and proposes deterministically;
- a *model* drafter (`Drafter`: the draft model) proposes up to k tokens per sequence during
  the step, with the *processed* distribution it sampled them from (`draft_probs`, rows
  `[k, vocab]`), or `None` for greedy drafts.
The verifier treats a proposal without a distribution as one-hot. After the target's verify
pass the controller tells the drafters how many proposed tokens were accepted, so they can
roll their own state (a draft model's KV cache length) back by arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specserve.speculative.candidate import Candidate


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # [k] proposed tokens (k may be 0: a plain decode round)
    draft_probs: torch.Tensor | None  # [k, vocab] processed draft distribution, None = one-hot

    @property
    def k(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None)


class DraftSequence(Protocol):
    """What the drafter reads of a sequence (the engine's `Sequence` is one)."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator

    @property
    def prompt_len(self) -> int: ...


class LookupSource(Protocol):
    def candidate(self, seq: DraftSequence, limit: int) -> "Candidate":
        """The continuation it would propose after `seq.token_ids` (at most `limit` tokens)."""

    def finish(self, seq: DraftSequence, keep: bool = True) -> None:
        """The sequence left (`keep`: it completed, and its output may be learned from)."""


class Drafter(Protocol):
    def start(self, seq: DraftSequence) -> None:
        """A sequence joins (when the scheduler admits it; its prompt may still be prefilling)."""

    def ready(self, seq: DraftSequence) -> bool:
        """Whether the sequence can be asked for drafts this round (a draft model's own
        prefill of it may be deferred or still under way)."""

    def started(self, seq: DraftSequence) -> bool:
        """Whether `activate` ran for the sequence (a drafter that is always ready: True)."""

    def startup_tokens(self, seq: DraftSequence) -> int:
        """Draft prefill positions that `activate` would cost now (what the policy weighs)."""

    def activate(self, seq: DraftSequence) -> None:
        """Start drafting for a sequence that is not `started` (a draft model's deferred
        prefill begins)."""

    def pending(self) -> bool:
        """Whether `propose` has work even when no sequence drafts (a draft prefill)."""

    def propose(self, seqs: list[DraftSequence], ks: list[int]) -> list[Proposal]:
        """Up to `ks[i]` tokens following `seqs[i].token_ids`, for all sequences in one batch
        (`ks[i] > 0` only for ready sequences)."""

    def commit(self, seq: DraftSequence, num_accepted: int, old_len: int) -> None:
        """The verify pass kept `num_accepted` proposed tokens; `seq.token_ids` already holds
        them plus one recovered or bonus token. `old_len` is the length before the round."""

    def finish(self, seq: DraftSequence) -> None:
        """The sequence left; release what the drafter held for it."""
