"""Which sequences run in a step, and with how many tokens each: a token budget, KV blocks,
slots shared among clients, first come first served within a client.

Every step is one target pass. It holds, in this order:
1. a decode or verify row group (the last token plus k drafts) for every scheduled sequence
   that has finished its prefill, oldest first; each grows its blocks to hold them. When the
   blocks run out, a held sequence is preempted first, else the newest running one (its
   blocks freed, itself put back at the front of the waiting queue to be recomputed later),
   until the growth fits;
2. prefill chunks, with what is left of `max_num_batched_tokens` (decode rows always run):
   first for scheduled sequences still prefilling, oldest first, then for waiting sequences,
   admitted while the budget, a free slot and the blocks allow (a held sequence is preempted
   to make room for one that cannot otherwise fit). A new sequence first takes the blocks of
   its prompt that the prefix cache holds.

Slots: at most `max_num_seqs` sequences are scheduled in a step: the running ones that are not
held, oldest first. A held sequence (`hold`: its reader has more than a bounded amount of its
output unread) keeps its blocks and its place but is not scheduled and leaves its slot to the
others; released, it is scheduled again once a slot is free.

Clients (`Sequence.client`, whom a request serves: one user's burst must not hold every slot):
the next sequence admitted is the oldest waiting one of the client that runs the fewest now;
when every slot is taken and a waiting sequence's client runs at least two fewer than the
client that runs the most, that client's newest sequence is preempted for it (one per step),
so the slots even out among the clients that want them while one client alone may use all.

Admission keeps one free block per decoding sequence in reserve (a watermark), so a newly
admitted prompt does not take the blocks the running sequences need for their next rows and
then get preempted at once. A sequence that does not fit in the whole cache cannot exist: the
engine refuses a cache smaller than one `max_model_len` sequence.
"""

from __future__ import annotations

from collections import Counter, deque
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

    def has_runnable(self) -> bool:
        """Whether a sequence that is not held waits or runs (a step would do something)."""
        return any(not s.held for s in self.running) or any(not s.held for s in self.waiting)

    def hold(self, seqs: list[Sequence], held: bool) -> None:
        """Hold sequences (not scheduled, their slots to others) or release them."""
        for seq in seqs:
            seq.held = held

    @property
    def num_held(self) -> int:
        return sum(s.held for s in self.running) + sum(s.held for s in self.waiting)

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
    def scheduled(self) -> list[Sequence]:
        """The running sequences a step runs: those not held, oldest first, at most
        `max_num_seqs` of them."""
        return [s for s in self.running if not s.held][:self.max_num_seqs]

    def decoding(self) -> list[Sequence]:
        """The scheduled sequences past their prefill, oldest first: the next step's decode
        rows (whose drafts the speculation controller plans before `schedule`)."""
        return [s for s in self.scheduled() if not s.prefilling]

    def has_prefill_work(self) -> bool:
        """Whether a prompt is prefilling or waiting to (the next step may carry a chunk)."""
        return any(not s.held for s in self.waiting) or any(s.prefilling
                                                            for s in self.scheduled())

    def schedule(self, drafts: dict[int, int] | None = None) -> StepPlan:
        """Plan one step; `drafts` maps a decoding sequence's id to the drafts it wants
        verified (absent: none). A sequence gets fewer (none) when its blocks cannot grow
        for them without preempting; the plan's `preempted` sequences lost their blocks."""
        plan = StepPlan()
        drafts = drafts or {}
        self._rebalance(plan)
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
        for seq in [s for s in self.scheduled() if s.prefilling]:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue
            n = self._chunk(seq, budget, plan)
            budget -= n
        while budget > 0 and self._free_slots() > 0:
            seq = self._next_waiting()
            if seq is None or seq in plan.preempted:
                break  # none, or it just gave its blocks up: no room for it in this step
            n = self._admit(seq, budget, plan)
            if n < 0:
                break
            budget -= n
        return plan

    def _free_slots(self) -> int:
        return self.max_num_seqs - sum(1 for s in self.running if not s.held)

    def _active(self) -> Counter:
        """Sequences each client has running and not held."""
        return Counter(s.client for s in self.running if not s.held)

    def _next_waiting(self) -> Sequence | None:
        """The waiting sequence to admit next: not held, of the client that runs the fewest
        now, the oldest of that client's (the queue's order: a preempted one first)."""
        active = self._active()
        best, fewest = None, None
        for seq in self.waiting:
            if seq.held:
                continue
            count = active[seq.client]
            if fewest is None or count < fewest:
                best, fewest = seq, count
        return best

    def _rebalance(self, plan: StepPlan) -> None:
        """Every slot taken and a waiting sequence's client running at least two fewer than
        the client that runs the most: that client's newest running sequence gives its slot
        up (preempted; it waits and is recomputed later)."""
        if self._free_slots() > 0:
            return
        waiting = self._next_waiting()
        if waiting is None:
            return
        active = self._active()
        top = max(active, key=active.get, default=None)
        if top is None or active[top] < active[waiting.client] + 2:
            return
        victim = next(s for s in reversed(self.running) if s.client == top and not s.held)
        self._preempt(victim, plan)

    def _victim(self) -> Sequence:
        """The sequence to preempt when blocks run out: the newest held one, else the newest."""
        return next((s for s in reversed(self.running) if s.held), self.running[-1])

    def _grow(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Blocks for `num_tokens` positions of `seq`, preempting the newest running sequences
        while they do not fit; False when `seq` itself was preempted."""
        while not self.blocks.reserve(seq.table, num_tokens):
            victim = self._victim()
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
        """Admit a waiting sequence with its first chunk (preempting held sequences while it
        does not fit otherwise); −1 when it must wait."""
        # a fresh prompt needs its last position computed (its logits); a recomputation not
        tokens = seq.token_ids
        limit = seq.prefill_end - (1 if seq.prefill_end == len(tokens) else 0)
        hit = self.blocks.match_prefix(seq.table, tokens, limit)
        seq.num_cached = hit
        n = self._fits(seq, hit, budget)
        while n <= 0 and seq.prefill_end > hit and any(s.held for s in self.running):
            self._preempt(self._victim(), plan)
            n = self._fits(seq, hit, budget)
        if n <= 0 and seq.prefill_end > hit:
            self.blocks.free(seq.table)  # waiting sequences hold no blocks
            seq.num_cached = 0
            return -1
        self.waiting.remove(seq)
        self.blocks.reserve(seq.table, hit + n)
        seq.status = Status.RUNNING
        self.running.append(seq)
        plan.admitted.append(seq)
        self.prefix_cache_hit_tokens += hit
        if seq.num_output == 0:
            seq.prefix_hit = hit
        if n > 0:
            plan.chunks.append(Chunk(seq, hit, n))
            self.prompt_tokens_computed += n
        return n

    def _fits(self, seq: Sequence, hit: int, budget: int) -> int:
        """Prompt positions beyond `hit` that `seq`'s first chunk may take now: within the
        budget and the blocks, one free block kept per decoding sequence (the watermark)."""
        watermark = sum(1 for s in self.running if not s.prefilling and not s.held)
        spare = self.blocks.num_available - watermark
        n = min(seq.prefill_end - hit, budget)
        return min(n, len(seq.table.blocks) * self.blocks.block_size
                   + spare * self.blocks.block_size - hit)

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
