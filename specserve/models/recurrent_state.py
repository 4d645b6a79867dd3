"""Per-sequence state of the linear-attention layers, with snapshots that make rollback free.

A Gated DeltaNet layer carries, per sequence, a recurrent state `[v_heads, v_head_dim,
k_head_dim]` (Sᵀ) and a convolution state `[conv_dim, kernel - 1]` (its last inputs). The engine
rolls a KV cache back by arithmetic: a sequence's next pass starts at its `num_cached`, and
what rejected drafts wrote is overwritten later. The same contract holds here: each sequence
keeps the states *after* each of its newest positions (snapshots, at most `history` of them),
and a pass that starts at position s continues from the snapshot of s, the state after tokens
[0, s). Rejecting a draft copies and recomputes nothing; the next pass simply starts from an
earlier snapshot. A pass at 0 starts from zeros (a new sequence, or a preempted one computed
again). A start with no snapshot is an internal error (`assert`): the engine never starts a
pass past what it computed, nor further back than a round's drafts.

Sequences are named by a key (the engine's `BlockTable`); `release(key)` drops a sequence's
snapshots (the block manager calls it when it frees the table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_DTYPE = torch.float32  # the recurrence runs in float32 whatever the weights' dtype


@dataclass(slots=True)
class Snapshots:
    """`states[j]` holds every linear layer's (conv, ssm) after tokens [0, first + j)."""

    first: int
    states: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [position][linear layer]


class RecurrentStates:
    """The snapshots of every sequence, for `num_layers` linear layers of the given shapes."""

    def __init__(self, num_layers: int, conv_shape: tuple[int, int],
                 ssm_shape: tuple[int, int, int], history: int) -> None:
        if history < 2:
            raise ValueError(f"state history must be >= 2 positions, got {history}")
        self.num_layers, self.history = num_layers, history
        self.conv_shape, self.ssm_shape = conv_shape, ssm_shape
        self._seqs: dict[object, Snapshots] = {}

    def __len__(self) -> int:
        """Sequences holding snapshots."""
        return len(self._seqs)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one position's snapshot over every linear layer."""
        per_layer = (self.conv_shape[0] * self.conv_shape[1]
                     + self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2])
        return self.num_layers * per_layer * torch.finfo(STATE_DTYPE).bits // 8

    def positions(self, key: object) -> range:
        """The start positions a pass of `key` may take now (besides 0)."""
        snaps = self._seqs.get(key)
        return range(0) if snaps is None else range(snaps.first,
                                                    snaps.first + len(snaps.states))

    def initial(self, key: object, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per linear layer, (conv `[conv_dim, kernel - 1]`, ssm `[v_heads, dv, dk]`): the
        states after tokens [0, start) of `key` (zeros at 0)."""
        if start == 0:
            return [(torch.zeros(self.conv_shape, dtype=STATE_DTYPE),
                     torch.zeros(self.ssm_shape, dtype=STATE_DTYPE))] * self.num_layers
        assert start in self.positions(key), (
            f"no recurrent state after position {start} of this sequence (held: "
            f"{list(self.positions(key))}); a pass may start only where an earlier one ended "
            f"or at one of its rows")
        snaps = self._seqs[key]
        return snaps.states[start - snaps.first]

    def store(self, key: object, start: int, rows: int, conv: list[torch.Tensor],
              ssm: list[torch.Tensor]) -> None:
        """Record a pass of `rows` tokens from `start`: `conv[i]`, `ssm[i]` hold layer i's
        states after its last m rows (m = min(rows, history)), oldest first. Snapshots of
        positions up to `start` stay (the pass may be redone or rolled back into), later ones
        are replaced, and only the newest `history` are kept. Nothing is copied: the
        snapshots are views of the pass's own state tensors."""
        m = conv[0].shape[0]
        assert 0 < m <= rows and m == min(rows, self.history)
        new = [[(c[j], s[j]) for c, s in zip(conv, ssm)] for j in range(m)]
        old = self._seqs.get(key)
        kept = [] if start == 0 or old is None else old.states[:start - old.first + 1]
        states = (kept + new)[-self.history:]
        self._seqs[key] = Snapshots(start + rows + 1 - len(states), states)

    def release(self, key: object) -> None:
        """Forget `key`'s snapshots (nothing happens for a key without any)."""
        self._seqs.pop(key, None)
