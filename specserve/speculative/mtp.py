"""Drafting with the target's own multi-token-prediction head (`models/mtp_head.py`).

The head predicts token x_{p+2} from the target's final hidden state h_p and token x_{p+1}, so
it needs the target's hidden states: the engine hands them over after each target pass
(`observe(seq, start, hidden)`: rows of positions start...). Before proposing, the head catches
up on the positions it has not computed from the target's states (p = fed ... n - 2 for a
sequence of n tokens; the last one gives the first draft); each further draft feeds the head's
own output back with the drafted token. Draft rows write the head's KV cache past `fed`, with
the head's states instead of the target's, so after verification they are forgotten by
arithmetic, `fed = min(fed, old_len - 1)`, and recomputed from the target's states next round.

It implements the `Drafter` interface (`drafter.py`); as every drafter, it changes only how
many drafts are accepted, never the output: the verifier judges each draft against the
distribution it was sampled from (`draft_probs`, or one-hot for greedy drafts).
"""

from __future__ import annotations

import torch

from specserve.models.transformer import ForwardBatch
from specserve.sampling.processors import (argmax_rows, greedy_scores, needs_history,
                                           processed_probs)
from specserve.sampling.rejection import sample_from
from specserve.speculative.draft_model import DraftBlocks
from specserve.speculative.drafter import EMPTY, BuildContext, DraftSequence, Drafter, Proposal


class _MTPSeq:
    __slots__ = ("table", "fed", "hidden")

    def __init__(self, table) -> None:
        self.table = table  # the head's KV blocks
        self.fed = 0  # head positions 0..fed-1 were computed from the target's hidden states
        self.hidden: dict[int, torch.Tensor] = {}  # position → the target's h_p [hidden]


class MTPDrafter(Drafter):
    """Drafts from `model.mtp` (a `HybridModel` whose checkpoint has an MTP head) over `pool`
    (`model.mtp.new_pool(...)`), whose blocks `blocks` hands out (a block manager without
    prefix caching, owned by this drafter)."""

    name, in_step, needs_hidden = "mtp", True, True

    def __init__(self, model, pool, blocks: DraftBlocks) -> None:
        if getattr(model, "mtp", None) is None:
            raise ValueError("the target model has no multi-token-prediction head (its "
                             "checkpoint carries no mtp.* tensors)")
        self.model, self.head, self.pool, self.blocks = model, model.mtp, pool, blocks
        self._seqs: dict[int, _MTPSeq] = {}

    @classmethod
    def build(cls, config, ctx: BuildContext) -> MTPDrafter:
        return cls.of(ctx.runner)

    @staticmethod
    def of(runner) -> "MTPDrafter":
        """The drafter of `runner`'s model's head, with pools as large as the runner's and a
        block manager of its own without prefix caching (freeing its tables touches none of
        the target's state)."""
        if runner is None:
            raise ValueError("method 'mtp' drafts with the target's own head: the target's "
                             "runner is needed")
        model = runner.model
        if getattr(model, "mtp", None) is None:
            raise ValueError("method 'mtp': the target model has no multi-token-prediction "
                             "head (its checkpoint carries no mtp.* / nextn tensors)")
        return MTPDrafter(model, model.mtp.new_pool(runner.num_blocks, runner.block_size),
                          runner.block_manager(False))

    # ------------------------------------------------------------------ lifecycle
    def start(self, seq: DraftSequence) -> None:
        self._seqs[seq.seq_id] = _MTPSeq(self.blocks.new_table())

    def started(self, seq: DraftSequence) -> bool:
        return seq.seq_id in self._seqs

    def activate(self, seq: DraftSequence) -> None:
        """Nothing to start: the head catches up with its first proposal."""

    def startup_tokens(self, seq: DraftSequence) -> int:
        st = self._seqs.get(seq.seq_id)
        return 0 if st is None else max(0, len(seq.token_ids) - 1 - st.fed)

    def pending(self) -> bool:
        return False

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    def ready(self, seq: DraftSequence) -> bool:
        """Whether the target's states of every position the head must catch up on are here."""
        st = self._seqs.get(seq.seq_id)
        return st is not None and all(p in st.hidden
                                      for p in range(st.fed, len(seq.token_ids) - 1))

    def observe(self, seq: DraftSequence, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states `[n, hidden]` of positions start..start + n - 1
        (a later pass over a position replaces what an earlier one gave)."""
        st = self._seqs[seq.seq_id]
        for j in range(hidden.shape[0]):
            st.hidden[start + j] = hidden[j]

    def commit(self, seq: DraftSequence, num_accepted: int, old_len: int) -> None:
        """Forget the head positions the draft rows wrote (from old_len - 1 on) and the
        target's states it no longer needs."""
        st = self._seqs[seq.seq_id]
        st.fed = min(st.fed, old_len - 1)
        st.hidden = {p: h for p, h in st.hidden.items() if st.fed <= p < len(seq.token_ids)}

    def finish(self, seq: DraftSequence, keep: bool = True) -> None:
        st = self._seqs.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.free(st.table)

    # ------------------------------------------------------------------ drafting
    def propose(self, seqs: list[DraftSequence], ks: list[int]) -> list[Proposal]:
        """Up to `ks[i]` drafts after `seqs[i].token_ids`: one pass catching up every drafting
        sequence, then one pass per further draft."""
        drafts: dict[int, tuple[list[int], list[torch.Tensor]]] = {}  # tokens, their probs
        active = []  # (seq, k, state)
        for seq, k in zip(seqs, ks):
            st = self._seqs[seq.seq_id]
            if k > 0 and self.blocks.reserve(st.table, len(seq.token_ids) - 2 + k):
                assert self.ready(seq), "propose asked for a sequence the head cannot catch up"
                active.append((seq, k, st))
                drafts[seq.seq_id] = ([], [])
        rows = [seq.token_ids[st.fed + 1:] for seq, _, st in active]
        starts = [st.fed for _, _, st in active]
        prev = [torch.stack([st.hidden[p] for p in range(st.fed, len(seq.token_ids) - 1)])
                for seq, _, st in active]  # [rows, hidden] each
        for seq, _, st in active:
            st.fed = len(seq.token_ids) - 1
        while active:
            out = self._pass(rows, starts, [st.table for _, _, st in active], prev)
            for (seq, _, _), h in zip(active, out):
                self._sample(seq, self.model.logits(h[None]), *drafts[seq.seq_id])
            keep = [i for i, (seq, k, _) in enumerate(active) if len(drafts[seq.seq_id][0]) < k]
            active, prev = [active[i] for i in keep], [out[i][None] for i in keep]
            # the row after j drafts: d_j at position n - 2 + j, the head's last output as h
            rows = [[drafts[seq.seq_id][0][-1]] for seq, _, _ in active]
            starts = [len(seq.token_ids) - 2 + len(drafts[seq.seq_id][0]) for seq, _, _ in active]
        return [self._proposal(k, drafts.get(seq.seq_id)) for seq, k in zip(seqs, ks)]

    def _pass(self, rows: list[list[int]], starts: list[int], tables: list,
              prev: list[torch.Tensor]) -> list[torch.Tensor]:
        """One pass of the head; returns each sequence's last output row `[hidden]`."""
        batch = ForwardBatch.paged(rows, starts, [t.blocks for t in tables], tables)
        with torch.inference_mode():
            out = self.head.hidden_states(self.model, batch, torch.cat(prev), self.pool)
        ends = torch.tensor([len(r) for r in rows]).cumsum(0) - 1
        return list(out[ends])

    def _sample(self, seq: DraftSequence, logits: torch.Tensor, tokens: list[int],
                probs: list[torch.Tensor]) -> None:
        """Draw the next draft from `logits` `[1, vocab]` as the verifier will judge it."""
        history = seq.token_ids + tokens if needs_history(seq.params) else seq.token_ids
        if seq.params.greedy:
            tokens.append(argmax_rows(greedy_scores(logits, seq.params, history,
                                                    seq.prompt_len))[0])
        else:
            p = processed_probs(logits, seq.params, history, seq.prompt_len)[0]  # [vocab]
            tokens.append(sample_from(p, torch.rand((), generator=seq.generator)))
            probs.append(p)

    @staticmethod
    def _proposal(k: int, drafted) -> Proposal:
        if k == 0 or drafted is None:
            return EMPTY
        tokens, probs = drafted
        return Proposal(list(tokens), torch.stack(probs) if probs else None)  # [k, vocab]
