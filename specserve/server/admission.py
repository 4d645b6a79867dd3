"""`Admission`: how many sequences the server has taken on, and refusing more (429).

Each API request holds `prompts × n` sequences from admission until the engine is done with
it (its last delta, or its abort), however long its client then takes to read the answer.
The engine runs `slots` of them at once; at most `max_waiting` more may wait for a slot. A
request that would pass that bound is refused at once with 429 and a `Retry-After` header
instead of queueing without end (a request that finds nothing admitted is always taken, or
one larger than the bound could never run). Counting happens on the event loop, at
admission, so the bound holds however fast requests arrive (the engine's own counts lag a
step).
"""

from __future__ import annotations

from specserve.server.errors import APIError


class Admission:
    def __init__(self, slots: int | None, max_waiting: int, retry_after_s: int) -> None:
        self.capacity = (slots or 0) + max_waiting
        self.retry_after_s = retry_after_s
        self.held = 0  # sequences of the requests admitted and not yet done

    def admit(self, sequences: int) -> "Ticket":
        """A ticket for `sequences` more, or a 429 when they do not fit."""
        self.refuse_unless_room(sequences)
        self.held += sequences
        return Ticket(self, sequences)

    def refuse_unless_room(self, sequences: int) -> None:
        """429 when `sequences` more would not be admitted now (nothing is held for them: a
        request checks before the work that precedes its admission)."""
        if self.held + sequences > self.capacity and self.held > 0:
            raise APIError(429, f"the server is at capacity ({self.held} sequences admitted, room "
                           f"for {self.capacity}); retry after {self.retry_after_s} s",
                           code="server_overloaded", type="rate_limit_error",
                           headers={"Retry-After": str(self.retry_after_s)})


class Ticket:
    """One admitted request's hold; `release` (idempotent) gives it back."""

    __slots__ = ("_admission", "_sequences")

    def __init__(self, admission: Admission, sequences: int) -> None:
        self._admission, self._sequences = admission, sequences

    def release(self) -> None:
        self._admission.held -= self._sequences
        self._sequences = 0
