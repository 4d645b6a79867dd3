"""Which sequences run this step: waiting requests join while KV slots are free."""

from __future__ import annotations

from collections import deque

from specserve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self, free_slots: int) -> list[Sequence]:
        """Move waiting sequences to running, first come first served."""
        room = min(free_slots, self.max_num_seqs - len(self.running))
        admitted = []
        while self.waiting and room > 0:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
            room -= 1
        self.running += admitted
        return admitted

    def retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
