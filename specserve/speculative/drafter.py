"""The drafter interface: every source of drafts implements `Drafter`.

A drafter declares what it is with attributes, and the speculation controller (`controller.py`)
reads only those, never its class:

- `in_step`: it drafts during the step with a model pass (a draft model, the target's MTP
  head), up to k tokens per sequence, with the *processed* distribution it sampled them from
  (`Proposal.draft_probs`, rows `[k, vocab]`, or None for greedy drafts), at a cost the cost
  model prices per draft step. Otherwise it is *free*: before the step it offers a candidate
  continuation (`candidate`, with a confidence per position: suffix drafting, prompt lookup,
  grammar forcing), found in text it already has, proposed deterministically.
- `forced`: its candidates are tokens a sequence's grammar forces; they are offered before
  the other free drafters' and priced by their running survival (`survival`, `learn`).
- `needs_mask`: it drafts only for a sequence with a grammar (whose masks it reads).
- `needs_hidden`: it drafts from the target's final hidden states, which it is handed after
  every target pass (`observe`).

The verifier treats a proposal without a distribution as one-hot. After the target's verify
pass the controller tells the drafters how many proposed tokens were accepted (`commit`), so
they roll their own state (a draft model's KV cache length) back by arithmetic.

Which drafters a method uses is one table, `sources.SOURCES` (method → drafter classes); each
class builds itself from the config (`build`). A new drafter is a new file with a `Drafter`
subclass and its class in the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from specserve.sampling.params import SamplingParams
from specserve.speculative.candidate import NO_CANDIDATE, Candidate


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # [k] proposed tokens (k may be 0: a plain decode round)
    draft_probs: torch.Tensor | None  # [k, vocab] processed draft distribution, None = one-hot

    @property
    def k(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None)
D = TypeVar("D", bound="Drafter")


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a drafter may be built from besides the SpeculativeConfig."""

    draft_runner: object = None  # the draft model's runner (None: no draft model)
    target_vocab: int = 0
    max_prefill_tokens: int = 256
    prefix_caching: bool = True
    runner: object = None  # the target's runner
    head_keep: list[int] | None = None  # the draft tokens a restricted head keeps (specials)


class DraftSequence(Protocol):
    """What the drafter reads of a sequence (the engine's `Sequence` is one)."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator

    @property
    def prompt_len(self) -> int: ...


class Drafter:
    """The interface, with what a drafter that has nothing to do for a call does."""

    name: str = ""  # the source's name in metrics and the step trace
    in_step: bool = False  # drafts during the step (a model pass), else free (`candidate`)
    forced: bool = False  # its candidates are forced tokens (offered first)
    needs_mask: bool = False  # drafts only for a sequence with a grammar
    needs_hidden: bool = False  # reads the target's final hidden states (`observe`)
    runner = None  # a model runner of its own (a draft model's): the engine sets its prefill path

    @classmethod
    def build(cls: type[D], config, ctx: BuildContext) -> D | None:
        """The drafter a SpeculativeConfig asks for (None: the config leaves it out)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ every drafter
    def join(self, seqs: list[DraftSequence], tokenizer=None) -> None:
        """A request's sequences join (`tokenizer` given: other renderings of the prompt may
        be indexed)."""

    def finish(self, seq: DraftSequence, keep: bool = True) -> None:
        """The sequence left; release what the drafter held for it (`keep`: it completed, and
        its output may be learned from)."""

    def clear(self) -> None:
        """Forget what earlier requests taught (a cache of their outputs)."""

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefix blocks no sequence holds."""

    def startup(self) -> None:
        """Start-up work, on the thread that steps the engine, before the first pass."""

    @property
    def kv_touched_bytes(self) -> int:
        """Bytes of the drafter's KV pool ever taken (0: none)."""
        return 0

    # ------------------------------------------------------------------ free drafters
    def candidate(self, seq: DraftSequence, limit: int, extra: list[int] = ()) -> Candidate:
        """The continuation it would propose after `seq.token_ids` and then `extra` (tokens
        the round drafts before it), at most `limit` tokens."""
        return NO_CANDIDATE

    def survival(self, n: int) -> list[float]:
        """(forced drafters) P(the first i of n offered tokens all survive), i = 1..n."""
        return [1.0] * n

    def learn(self, verified: int, accepted: int) -> None:
        """(forced drafters) `verified` of its tokens reached the verifier; `accepted` kept."""

    # ------------------------------------------------------------------ in-step drafters
    def start(self, seq: DraftSequence) -> None:
        """A sequence joins (when the scheduler admits it; its prompt may still be prefilling)."""

    def ready(self, seq: DraftSequence) -> bool:
        """Whether the sequence can be asked for drafts this round (a draft model's own
        prefill of it may be deferred or still under way)."""
        return True

    def started(self, seq: DraftSequence) -> bool:
        """Whether `activate` ran for the sequence (a drafter that is always ready: True)."""
        return True

    def startup_tokens(self, seq: DraftSequence) -> int:
        """Draft prefill positions that `activate` would cost now (what the policy weighs)."""
        return 0

    def activate(self, seq: DraftSequence) -> None:
        """Start drafting for a sequence that is not `started` (a draft model's deferred
        prefill begins)."""

    def pending(self) -> bool:
        """Whether `propose` has work even when no sequence drafts (a draft prefill)."""
        return False

    def propose(self, seqs: list[DraftSequence], ks: list[int]) -> list[Proposal]:
        """Up to `ks[i]` tokens following `seqs[i].token_ids`, for all sequences in one batch
        (`ks[i] > 0` only for ready sequences)."""
        return [EMPTY] * len(seqs)

    def commit(self, seq: DraftSequence, num_accepted: int, old_len: int) -> None:
        """The verify pass kept `num_accepted` proposed tokens; `seq.token_ids` already holds
        them plus one recovered or bonus token. `old_len` is the length before the round."""

    def observe(self, seq: DraftSequence, start: int, hidden: torch.Tensor) -> None:
        """(`needs_hidden`) The target's final hidden states `[rows, hidden]` of `seq` from
        position `start` on."""
