"""Which sequences run in a step, and with how many tokens each: a token budget, KV blocks,
first come first served.

Every step is one target pass. It holds, in this order:
1. a decode or verify row group (the last token plus k drafts) for every running sequence
   that has finished its prefill, oldest first; each grows its blocks to hold them. When the
   blocks run out, the newest running sequence is preempted (its blocks freed, itself put
   back at the front of the waiting queue to be recomputed later) until the growth fits;
2. prefill chunks, with what is left of `max_num_batched_tokens` (decode rows always run):
   first for running sequences still prefilling, oldest first, then for waiting sequences,
   which are admitted in arrival order while the budget, `max_num_seqs` and the blocks allow.
   A new sequence first takes the blocks of its prompt that the prefix cache holds.

Admission keeps one free block per running sequence in reserve (a watermark), so a newly
admitted prompt does not take the blocks the running sequences need for their next rows and
then get preempted at once. A sequence that does not fit in the whole cache cannot exist: the
engine refuses a cache smaller than one `max_model_len` sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class Chunk:
    seq: Sequence
    start: int  # first position fed
    num_tokens: int

    @property
    def prompt_rows(self) -> int:
        """Its leading rows that are prompt tokens (the rest, after a preemption, recompute
        output tokens: those keep the path that computed them first, the decode rows')."""
        return max(0, min(self.num_tokens, self.seq.prompt_len - self.start))

    @property
    def samples(self) -> bool:
        """The prompt's last chunk: its last row's logits give the sequence's first token."""
        end = self.start + self.num_tokens
        return end == self.seq.prefill_end == len(self.seq.token_ids)


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)  # prefilled, oldest first
    ks: list[int] = field(default_factory=list)  # drafts to verify per decoding sequence
    chunks: list[Chunk] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # joined running this step
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 blocks: BlockManager) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest last
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0  # prompt positions taken from the prefix cache
        self.prompt_tokens_computed = 0  # prompt (and recomputed) positions fed to the target

    def add(self, seq: Sequence) -> None:
        seq.prefill_end = len(seq.token_ids)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def retire(self) -> list[Sequence]:
        """Take the finished sequences out of the running set and free their blocks."""
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        for seq in done:
            self.blocks.free(seq.table)
        return done

    def drop(self, seq: Sequence) -> None:
        """Take a waiting sequence out (an abort) and free what it holds."""
        self.waiting.remove(seq)
        self.blocks.free(seq.table)

    def commit(self, seq: Sequence) -> None:
        """The sequence's cached positions are final up to `num_cached`: its full blocks of
        them join the prefix cache."""
        self.blocks.register(seq.table, seq.token_ids, seq.num_cached)

    # ------------------------------------------------------------------ the plan
    def decoding(self) -> list[Sequence]:
        """The running sequences past their prefill, oldest first: the next step's decode
        rows (whose drafts the speculation controller plans before `schedule`)."""
        return [s for s in self.running if not s.prefilling]

    def has_prefill_work(self) -> bool:
        """Whether a prompt is prefilling or waiting to (the next step may carry a chunk)."""
        return bool(self.waiting) or any(s.prefilling for s in self.running)

    def schedule(self, drafts: dict[int, int] | None = None) -> StepPlan:
        """Plan one step; `drafts` maps a decoding sequence's id to the drafts it wants
        verified (absent: none). A sequence gets fewer (none) when its blocks cannot grow
        for them without preempting; the plan's `preempted` sequences lost their blocks."""
        plan = StepPlan()
        drafts = drafts or {}
        for seq in self.decoding():
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            k = drafts.get(seq.seq_id, 0)
            if k and not self.blocks.reserve(seq.table, seq.num_cached + 1 + k):
                k = 0  # drafts are not worth preempting anyone
            if not self._grow(seq, seq.num_cached + 1, plan):
                continue  # it preempted itself
            plan.decode.append(seq)
            plan.ks.append(k)
        budget = self.max_num_batched_tokens - sum(k + 1 for k in plan.ks)
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue
            n = self._chunk(seq, budget, plan)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in plan.preempted:
                break  # it just gave its blocks up: no room for it in this step
            n = self._admit(seq, budget, plan)
            if n < 0:
                break
            budget -= n
        return plan

    def _grow(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Blocks for `num_tokens` positions of `seq`, preempting the newest running sequences
        while they do not fit; False when `seq` itself was preempted."""
        while not self.blocks.reserve(seq.table, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """The next prefill chunk of a running sequence; returns the tokens it takes."""
        n = min(seq.prefill_end - seq.num_cached, budget)
        n = min(n, self._room(seq))
        if n <= 0:  # no block at all: make room like a decode row would
            if not self._grow(seq, seq.num_cached + 1, plan):
                return 0
            n = min(seq.prefill_end - seq.num_cached, budget, self._room(seq))
        self.blocks.reserve(seq.table, seq.num_cached + n)
        plan.chunks.append(Chunk(seq, seq.num_cached, n))
        self.prompt_tokens_computed += n
        return n

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Admit the first waiting sequence with its first chunk; −1 when it must wait."""
        # a fresh prompt needs its last position computed (its logits); a recomputation not
        tokens = seq.token_ids
        limit = seq.prefill_end - (1 if seq.prefill_end == len(tokens) else 0)
        hit = self.blocks.match_prefix(seq.table, tokens, limit)
        seq.num_cached = hit
        watermark = sum(1 for s in self.running if not s.prefilling)
        n = min(seq.prefill_end - hit, budget)
        spare = self.blocks.num_available - watermark
        n = min(n, len(seq.table.blocks) * self.blocks.block_size + spare * self.blocks.block_size
                - hit)
        if n <= 0 and seq.prefill_end > hit:
            self.blocks.free(seq.table)  # waiting sequences hold no blocks
            seq.num_cached = 0
            return -1
        self.waiting.popleft()
        self.blocks.reserve(seq.table, hit + n)
        seq.status = Status.RUNNING
        self.running.append(seq)
        plan.admitted.append(seq)
        self.prefix_cache_hit_tokens += hit
        if n > 0:
            plan.chunks.append(Chunk(seq, hit, n))
            self.prompt_tokens_computed += n
        return n

    def _room(self, seq: Sequence) -> int:
        """Positions `seq` could hold beyond its cached ones with the blocks available now."""
        return (len(seq.table.blocks) + self.blocks.num_available) * self.blocks.block_size \
            - seq.num_cached

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free `seq`'s blocks and put it back at the front of the waiting queue: later it
        recomputes its prompt and output (every token but the last) and resumes."""
        self.running.remove(seq)
        if seq in plan.decode:  # already planned this step (an older one needed its blocks)
            i = plan.decode.index(seq)
            del plan.decode[i], plan.ks[i]
        for chunk in [c for c in plan.chunks if c.seq is seq]:
            plan.chunks.remove(chunk)
            self.prompt_tokens_computed -= chunk.num_tokens
        self.blocks.free(seq.table)
        seq.num_cached = 0
        seq.prefill_end = len(seq.token_ids) - (1 if seq.num_output > 0 else 0)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1
