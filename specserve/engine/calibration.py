"""Timed passes on this machine: the start-up calibration of the engine's cost model, and the
harness it (and the bench's verify-cost table) times passes with."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Callable, Hashable

import torch

PREFILL_ROWS = 64  # rows of the draft pass that prices a draft prefill position


def calibrate(cost, runner, draft_runner, cap: int, prefix_len: int = 32,
              repeats: int = 3) -> dict:
    """Seed `cost` (the engine's CostModel) from timed passes, so the first rounds already
    know this machine: target passes over k + 1 rows for k = 0..cap, and one draft-model step
    (`draft_runner` None: drafting is free). The calibration fixes the shape of cost against
    k for the engine's life, so it is taken with care: every pass is timed `repeats` times,
    all of them in turn round after round (drift hits each alike), and the median kept. Uses
    pools of its own blocks; returns what it measured."""
    with pass_timer(runner, prefix_len) as time_target, \
            (pass_timer(draft_runner, prefix_len) if draft_runner else nullcontext()) as time_draft:
        timers = {k: partial(time_target, k) for k in range(cap + 1)}
        if time_draft is not None:
            timers["draft"] = partial(time_draft, 0)
            # a draft pass over PREFILL_ROWS rows: its seconds per position price a draft start
            timers["draft_prefill"] = partial(time_draft, PREFILL_ROWS - 1)
        medians = median_round_robin(timers, repeats)
    draft_step = medians.pop("draft", 0.0)
    prefill = medians.pop("draft_prefill", None)
    per_position = prefill / PREFILL_ROWS if prefill is not None else None
    cost.seed(draft_step, medians, per_position)
    return {"draft_step_s": draft_step, "verify_s": medians, "draft_prefill_s": per_position}


def time_passes(runner, ks: list[int], prefix_len: int = 256, repeats: int = 5
                ) -> dict[int, float]:
    """Median seconds of a pass over k + 1 rows after a cached prefix of `prefix_len` tokens,
    for each k in `ks` (k = 0 is a decode step), timed in turn round after round."""
    with pass_timer(runner, prefix_len) as time_pass:
        return median_round_robin({k: partial(time_pass, k) for k in ks}, repeats)


@contextmanager
def pass_timer(runner, prefix_len: int, max_rows: int = 64):
    """A function k → seconds of one pass of `runner` over k + 1 random rows after a cached
    random prefix of `prefix_len` tokens (each pass rewrites the same positions; the first
    pass of each k is an untimed warm-up). Takes the blocks of one sequence of `prefix_len +
    max_rows` positions from a block manager of its own, so it must run while no sequence
    uses the pools (at start-up)."""
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    if not blocks.reserve(table, prefix_len + max_rows):
        raise RuntimeError("the KV cache has no room for a timing pass")
    rows: dict[int, list[list[int]]] = {}

    def time_pass(k: int) -> float:
        if k not in rows:
            rows[k] = [torch.randint(0, vocab, (k + 1,), generator=g).tolist()]
            runner.forward(rows[k], [prefix_len], [table])  # warm-up
        start = time.perf_counter()
        runner.forward(rows[k], [prefix_len], [table])
        return time.perf_counter() - start

    runner.forward([prefix], [0], [table], [1])
    yield time_pass


def median_round_robin(timers: dict[Hashable, Callable[[], float]], repeats: int
                       ) -> dict[Hashable, float]:
    """Median of `repeats` calls of each timer (a function returning seconds), called in turn
    round after round, so a machine that drifts meanwhile skews them alike."""
    samples: dict[Hashable, list[float]] = {key: [] for key in timers}
    for _ in range(repeats):
        for key, timer in timers.items():
            samples[key].append(timer())
    return {key: statistics.median(v) for key, v in samples.items()}
