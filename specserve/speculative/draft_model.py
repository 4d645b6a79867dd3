"""Drafting with a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache (one slot per sequence). Before proposing it catches up
on the tokens it has not seen (the last accepted tokens and the recovered/bonus token), then
samples k tokens one step at a time from the *processed* distribution (the same
`processed_probs` the verifier uses). After verification it forgets what was rejected:
`seen = min(seen, old_len + accepted)`.

Bounded catch-up: after rounds without drafting (a policy at k = 0) the unseen tail can be
long, and feeding it all would cost a draft prefill of every token decoded meanwhile, paid
by the probe that asks whether drafting pays again. So the draft is fed at most
`max_catchup` of the newest unseen tokens and skips the rest: its context gets a hole, its
positions run behind the target's by `skipped`. That changes only how good the drafts are,
never the output distribution: the verifier judges each draft against the distribution it
was actually sampled from.
"""

from __future__ import annotations

import torch

from specserve.engine.runner import ModelRunner
from specserve.engine.sequence import Sequence
from specserve.sampling.processors import needs_history, processed_probs
from specserve.sampling.rejection import sample_from
from specserve.speculative.drafter import EMPTY, Proposal


DEFAULT_MAX_CATCHUP = 4  # newest unseen tokens fed before drafting; older ones are skipped


class _DraftSeq:
    __slots__ = ("slot", "seen", "skipped", "tokens", "probs")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.seen = 0  # tokens of the sequence (target positions) the draft has accounted for
        self.skipped = 0  # of those, how many it never fed (bounded catch-up)
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []

    @property
    def num_cached(self) -> int:
        """The draft cache's length (its own positions)."""
        return self.seen - self.skipped


class DraftModelDrafter:
    def __init__(self, runner: ModelRunner, target_vocab: int,
                 max_catchup: int | None = DEFAULT_MAX_CATCHUP) -> None:
        if max_catchup is not None and max_catchup < 2:
            raise ValueError(f"max_catchup must be >= 2 or None (unbounded), got {max_catchup}")
        self.runner = runner
        self.target_vocab = target_vocab
        self.max_catchup = max_catchup
        self._seqs: dict[int, _DraftSeq] = {}

    def start(self, seq: Sequence) -> None:
        """Allocate a slot and prefill the prompt now, as part of the request's time to first
        token (like the target's prefill), not inside its first decoding round."""
        state = _DraftSeq(self.runner.cache.allocate())
        self._seqs[seq.seq_id] = state
        self.runner.forward([seq.prompt_ids], [0], [state.slot], [1])
        state.seen = seq.prompt_len

    def finish(self, seq: Sequence) -> None:
        state = self._seqs.pop(seq.seq_id, None)
        if state is not None:
            self.runner.cache.release(state.slot)

    def commit(self, seq: Sequence, num_accepted: int, old_len: int) -> None:
        state = self._seqs[seq.seq_id]
        state.seen = min(state.seen, old_len + num_accepted)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        active = [(seq, k, self._seqs[seq.seq_id]) for seq, k in zip(seqs, ks) if k > 0]
        for _, _, state in active:
            state.tokens, state.probs = [], []
        # catch up on unseen tokens (at most max_catchup), then one step per drafted token
        rows = [self._catch_up(seq, st) for seq, _, st in active]
        while active:
            logits = self.runner.forward(rows, [st.num_cached for _, _, st in active],
                                         [st.slot for _, _, st in active], [1] * len(active))
            for (seq, _, st), row, lg in zip(active, rows, logits):
                st.seen += len(row)
                self._sample(seq, st, lg)
            active = [(seq, k, st) for seq, k, st in active if len(st.tokens) < k]
            rows = [[st.tokens[-1]] for _, _, st in active]
        return [self._proposal(seq, k) for seq, k in zip(seqs, ks)]

    def _catch_up(self, seq: Sequence, st: _DraftSeq) -> list[int]:
        """The unseen tokens to feed; older ones beyond `max_catchup` are marked skipped."""
        unseen = len(seq.token_ids) - st.seen
        if self.max_catchup is not None and unseen > self.max_catchup:
            skip = unseen - self.max_catchup
            st.seen += skip
            st.skipped += skip
        return seq.token_ids[st.seen:]

    def _sample(self, seq: Sequence, st: _DraftSeq, logits: torch.Tensor) -> None:
        logits = self._align(logits)  # [1, target vocab]
        # the history is only read for penalties: skip copying the sequence when none are set
        history = seq.token_ids + st.tokens if needs_history(seq.params) else seq.token_ids
        probs = processed_probs(logits, seq.params, history, seq.prompt_len)
        if seq.params.greedy:
            st.tokens.append(int(probs[0].argmax()))
        else:
            u = torch.rand((), generator=seq.generator)
            st.tokens.append(sample_from(probs[0], u))
            st.probs.append(probs[0])

    def _proposal(self, seq: Sequence, k: int) -> Proposal:
        if k == 0:
            return EMPTY
        st = self._seqs[seq.seq_id]
        probs = torch.stack(st.probs) if st.probs else None  # [k, vocab] | None (greedy)
        return Proposal(list(st.tokens), probs)

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Match the target's vocabulary size: drop padded draft ids, or give ids the draft
        lacks zero probability."""
        vocab = logits.shape[-1]
        if vocab == self.target_vocab:
            return logits
        if vocab > self.target_vocab:
            return logits[..., :self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - vocab), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
