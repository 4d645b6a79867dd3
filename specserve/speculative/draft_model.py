"""Drafting with a smaller model that shares the target's tokenizer.

The draft keeps its own paged KV cache (its block manager is the drafter's) and samples each
draft from the same processed distribution the verifier uses (masked by the sequence's
grammar, if any). Invariants: before proposing it feeds the tokens it has not seen; after a
round it forgets what was rejected, `seen = min(seen, old_len + accepted)` (rollback is
arithmetic); its start is deferred until the controller's policy first wants drafts and then
feeds at most the newest `prefill_window` tokens; after rounds without drafting it catches up
on at most `max_catchup` tokens and skips older ones (a hole that lowers acceptance, never
changes the output law). When its cache is full a sequence drafts nothing that round.
Why: docs/design.md, "The draft model".
"""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.sampling.grammar import GrammarError
from specserve.sampling.processors import (argmax_rows, greedy_scores, needs_history,
                                           processed_probs)
from specserve.sampling.rejection import sample_from
from specserve.speculative.draft_head import restricted_head
from specserve.speculative.drafter import EMPTY, BuildContext, DraftSequence, Drafter, Proposal

DEFAULT_MAX_CATCHUP = 4  # newest unseen tokens fed before drafting; older ones are skipped
DEFAULT_MAX_PREFILL_TOKENS = 256  # draft prefill positions per call
DEFAULT_PREFILL_WINDOW = 1024  # newest tokens a starting draft is fed; older ones are skipped


class PassRunner(Protocol):
    """A model and its KV pools: runs passes over the blocks it is given (`ModelRunner`)."""

    model: object  # has `cfg.vocab_size`

    def forward(self, rows: list[list[int]], starts: list[int], tables: list,
                last_n: list[int] | None = None, prefill: list[int] | None = None
                ) -> list[torch.Tensor]: ...


class DraftBlocks(Protocol):
    """The draft cache's block manager (the engine's `BlockManager`), owned by the drafter."""

    def new_table(self) -> object: ...

    def reserve(self, table, num_tokens: int) -> bool: ...

    def free(self, table) -> None: ...

    def match_prefix(self, table, tokens: list[int], max_tokens: int) -> int: ...

    def register(self, table, tokens: list[int], num_committed: int) -> None: ...

    def reset_prefix_cache(self) -> int: ...


def _grammar_done(seq: DraftSequence) -> bool:
    """The sequence's grammar (following this round's drafts) allows nothing more."""
    grammar = getattr(seq, "grammar", None)
    return grammar is not None and grammar.is_terminated


class _DraftSeq:
    __slots__ = ("seq", "table", "started", "seen", "skipped", "prefilling", "fresh", "tokens",
                 "probs", "followed")

    def __init__(self, seq: DraftSequence) -> None:
        self.seq = seq
        self.table = None  # its draft blocks, from `activate` on
        self.started = False  # `activate` ran: the draft follows this sequence
        self.seen = 0  # tokens of the sequence (target positions) the draft has accounted for
        self.skipped = 0  # of those, how many it never fed (the window, bounded catch-up)
        self.prefilling = True  # fed in chunks until it has (nearly) caught up
        self.fresh = False  # started, ready, and its whole (windowed) tail still to be fed
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.followed = 0  # drafts the sequence's grammar accepted this round (rolled back)

    @property
    def num_cached(self) -> int:
        """The draft cache's length (its own positions)."""
        return self.seen - self.skipped


class DraftModelDrafter(Drafter):
    """`restrict`: (keep, extra) for `restrict_head` at start-up (None: the head is whole)."""

    name, in_step = "draft_model", True

    def __init__(self, runner: PassRunner, blocks: DraftBlocks, target_vocab: int,
                 max_catchup: int | None = DEFAULT_MAX_CATCHUP,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 prefill_window: int | None = DEFAULT_PREFILL_WINDOW,
                 restrict: tuple[int, list[int]] | None = None) -> None:
        if max_catchup is not None and max_catchup < 2:
            raise ValueError(f"max_catchup must be >= 2 or None (unbounded), got {max_catchup}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if prefill_window is not None and prefill_window < 1:
            raise ValueError(f"prefill_window must be >= 1 or None (whole context), got "
                             f"{prefill_window}")
        self.runner, self.blocks = runner, blocks
        self.target_vocab = target_vocab
        self.max_catchup = max_catchup
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_window = prefill_window
        self._seqs: dict[int, _DraftSeq] = {}  # by seq_id, in arrival order
        self._promised = 0  # prefill positions of fresh tails promised to the next `propose`
        self.prefix_hit_tokens = 0  # positions taken from the draft's prefix cache
        self.num_started = 0  # sequences whose draft was started (`activate`)
        self._restrict = restrict

    def startup(self) -> None:
        """The restricted head, if asked for (before the first pass)."""
        if self._restrict is not None:
            self.restrict_head(*self._restrict)
            self._restrict = None

    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    @property
    def kv_touched_bytes(self) -> int:
        return self.blocks.high_water * self.runner.block_bytes

    @classmethod
    def build(cls, config, ctx: BuildContext) -> DraftModelDrafter | None:
        """Where the config names a draft model: drafting through `ctx.draft_runner` with a
        block manager of its own (its head restricted at start-up where the config asks)."""
        if not config.uses_draft_model:
            return None
        restrict = (config.draft_vocab_size, list(ctx.head_keep)) \
            if config.draft_vocab_size is not None and ctx.head_keep is not None else None
        runner = ctx.draft_runner
        return cls(runner, runner.block_manager(ctx.prefix_caching), ctx.target_vocab,
                   max_prefill_tokens=ctx.max_prefill_tokens,
                   prefill_window=config.prefill_window, restrict=restrict)

    def restrict_head(self, keep: int, extra: list[int]) -> None:
        """Score only the draft's `keep` most frequent ids and `extra` (`restricted_head`):
        a cheaper draft step, still lossless. Run before the first pass."""
        self.runner.head = restricted_head(self.runner.model, keep, extra)

    # ------------------------------------------------------------------ lifecycle
    def start(self, seq: DraftSequence) -> None:
        """A sequence joins; nothing is fed or held until `activate`."""
        self._seqs[seq.seq_id] = _DraftSeq(seq)

    def started(self, seq: DraftSequence) -> bool:
        state = self._seqs.get(seq.seq_id)
        return state is not None and state.started

    def startup_tokens(self, seq: DraftSequence) -> int:
        """Draft prefill positions that starting the sequence now would cost at most (prefix
        cache hits, which only make it cheaper, are not looked up)."""
        n = len(seq.token_ids)
        return n if self.prefill_window is None else min(n, self.prefill_window)

    def activate(self, seq: DraftSequence) -> None:
        """Start the draft of a joined sequence: take what the draft's prefix cache holds of
        its tokens, skip all but the newest `prefill_window`, and feed the rest with the next
        `propose` (at once if it fits in that call's prefill budget, else in chunks)."""
        state = self._seqs[seq.seq_id]
        assert not state.started, "activate called twice for one sequence"
        tokens = seq.token_ids
        state.started, state.table = True, self.blocks.new_table()
        state.seen = self.blocks.match_prefix(state.table, tokens, len(tokens) - 1)
        self.prefix_hit_tokens += state.seen
        self.num_started += 1
        if self.prefill_window is not None:
            skip = len(tokens) - self.prefill_window - state.seen
            if skip > 0:  # a hole between the cached prefix (if any) and the window
                state.seen += skip
                state.skipped += skip
        tail = len(tokens) - state.seen
        if tail <= self.max_prefill_tokens - self._promised:
            state.prefilling, state.fresh = False, tail > 1
            self._promised += tail
        else:
            self._check_caught_up(seq, state)

    def finish(self, seq: DraftSequence, keep: bool = True) -> None:
        state = self._seqs.pop(seq.seq_id, None)
        if state is not None and state.table is not None:
            self.blocks.free(state.table)

    def ready(self, seq: DraftSequence) -> bool:
        """Whether the sequence can draft this round (started, its draft prefill done)."""
        state = self._seqs.get(seq.seq_id)
        return state is not None and state.started and not state.prefilling

    def pending(self) -> bool:
        """Whether some started sequence's draft prefill is still under way (chunks or a
        fresh tail to feed)."""
        return any(st.started and (st.prefilling or st.fresh) for st in self._seqs.values())

    def commit(self, seq: DraftSequence, num_accepted: int, old_len: int) -> None:
        state = self._seqs[seq.seq_id]
        if not state.started:
            return
        state.seen = min(state.seen, old_len + num_accepted)
        self._register(seq, state)

    # ------------------------------------------------------------------ drafting
    def propose(self, seqs: list[DraftSequence], ks: list[int]) -> list[Proposal]:
        """Drafts for `seqs` (k = ks[i]; only ready sequences may ask for k > 0), and in the
        same first pass, the next prefill chunks of sequences whose draft is still behind."""
        active = []
        for seq, k in zip(seqs, ks):
            state = self._seqs[seq.seq_id]
            state.tokens, state.probs = [], []
            if k > 0:
                assert self.ready(seq), "propose asked a sequence whose draft is not ready"
                row = self._catch_up(seq, state)
                # every position this round writes: catch-up, then k - 1 fed drafts
                if self.blocks.reserve(state.table, state.num_cached + len(row) + k - 1):
                    active.append((seq, k, state, row))
        fed_fresh = sum(len(row) for _, _, st, row in active if st.fresh)
        chunks = self._prefill_chunks({id(st) for _, _, st, _ in active},
                                      self.max_prefill_tokens - fed_fresh)
        self._promised = 0
        rows = [row for *_, row in active] + [row for _, _, row in chunks]
        starts = [st.num_cached for _, _, st, _ in active] + [st.num_cached for _, st, _ in chunks]
        tables = [st.table for _, _, st, _ in active] + [st.table for _, st, _ in chunks]
        last_n = [1] * len(active) + [0] * len(chunks)
        # the rows that are prompt tokens (each row's first ones) take the prefill path
        prompt = [_prompt_rows(seq, st, row) for seq, _, st, row in active] \
            + [_prompt_rows(seq, st, row) for seq, st, row in chunks]
        first = True
        while rows:
            logits = self.runner.forward(rows, starts, tables, last_n, prompt)
            if first:
                for seq, st, row in chunks:
                    st.seen += len(row)
                    st.fresh = False
                    self._register(seq, st)
                    self._check_caught_up(seq, st)
                first = False
            for (seq, _, st, row), lg in zip(active, logits):
                st.seen += len(row)
                st.fresh = False
                self._sample(seq, st, lg)
            active = [(seq, k, st, [st.tokens[-1]]) for seq, k, st, _ in active
                      if len(st.tokens) < k and not _grammar_done(seq)]
            rows = [row for *_, row in active]
            starts = [st.num_cached for _, _, st, _ in active]
            tables = [st.table for _, _, st, _ in active]
            last_n = [1] * len(active)
            prompt = None  # drafted tokens only
        for seq in seqs:  # the grammar followed the drafts: back to the sequence
            st = self._seqs[seq.seq_id]
            if st.followed:
                seq.grammar.rollback(st.followed)
                st.followed = 0
        return [self._proposal(seq, k) for seq, k in zip(seqs, ks)]

    def _prefill_chunks(self, drafting: set[int], budget: int
                        ) -> list[tuple[DraftSequence, _DraftSeq, list[int]]]:
        """The next prefill chunks within `budget` positions and the blocks available (all
        but the last token: the first catch-up feeds it): first the fresh tails of sequences
        not drafting this round (`drafting`: ids of the states that do), then the chunked
        prefills, oldest sequence first."""
        chunks = []
        fresh = [st for st in self._seqs.values() if st.fresh and id(st) not in drafting]
        prefilling = [st for st in self._seqs.values() if st.started and st.prefilling]
        for st in fresh + prefilling:
            seq = st.seq
            if budget <= 0:
                break
            n = min(len(seq.token_ids) - 1 - st.seen, budget)
            if n <= 0:
                st.fresh = False  # only the last token is left: the first catch-up feeds it
                continue
            while n > 0 and not self.blocks.reserve(st.table, st.num_cached + n):
                n //= 2  # the cache is nearly full: a smaller chunk, or none this time
            if n > 0:
                chunks.append((seq, st, seq.token_ids[st.seen:st.seen + n]))
                budget -= n
        return chunks

    def _check_caught_up(self, seq: DraftSequence, st: _DraftSeq) -> None:
        unseen = len(seq.token_ids) - st.seen
        st.prefilling = not (unseen <= 1 or (self.max_catchup is not None
                                             and unseen <= self.max_catchup))

    def _register(self, seq: DraftSequence, st: _DraftSeq) -> None:
        if st.skipped == 0:  # positions are token positions: full blocks can be shared
            self.blocks.register(st.table, seq.token_ids, min(st.seen, len(seq.token_ids)))

    def _catch_up(self, seq: DraftSequence, st: _DraftSeq) -> list[int]:
        """The unseen tokens to feed; older ones beyond `max_catchup` are marked skipped (a
        fresh tail, already windowed, is fed whole)."""
        unseen = len(seq.token_ids) - st.seen
        if not st.fresh and self.max_catchup is not None and unseen > self.max_catchup:
            skip = unseen - self.max_catchup
            st.seen += skip
            st.skipped += skip
        return seq.token_ids[st.seen:]

    def _sample(self, seq: DraftSequence, st: _DraftSeq, logits: torch.Tensor) -> None:
        """The next draft token, sampled as the target would be: from the processed
        distribution, masked by the sequence's grammar (which then follows the draft)."""
        logits = self._align(logits)  # [1, target vocab]
        grammar = getattr(seq, "grammar", None)
        if grammar is not None:
            try:
                logits = logits.masked_fill(~grammar.allowed()[None, :], float("-inf"))
            except GrammarError:  # it cannot go on: its round fails the sequence alone
                grammar = None
        # the history is only read for penalties: skip copying the sequence when none are set
        history = seq.token_ids + st.tokens if needs_history(seq.params) else seq.token_ids
        if seq.params.greedy:
            scores = greedy_scores(logits, seq.params, history, seq.prompt_len)
            st.tokens.append(argmax_rows(scores[:1])[0])
        else:
            probs = processed_probs(logits, seq.params, history, seq.prompt_len)
            u = torch.rand((), generator=seq.generator)
            st.tokens.append(sample_from(probs[0], u))
            st.probs.append(probs[0])
        if grammar is not None:
            accepted = grammar.accept(st.tokens[-1])
            assert accepted, "a token sampled under the grammar's mask is legal"
            st.followed += 1

    def _proposal(self, seq: DraftSequence, k: int) -> Proposal:
        st = self._seqs[seq.seq_id]
        if k == 0 or not st.tokens:
            return EMPTY
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


def _prompt_rows(seq: DraftSequence, st: _DraftSeq, row: list[int]) -> int:
    """How many of `row` (the tokens from `st.seen` on) are prompt tokens: they lead the row."""
    return max(0, min(len(row), seq.prompt_len - st.seen))
