"""Timed passes on this machine: the start-up calibration of the engine's cost model, and the
harness it (and the bench's verify-cost table) times passes with. A pass during which the
timing thread ran less than `SETTLED_SHARE` of its wall time was disturbed (another process
had the cores) and is timed again while patience lasts. Why: docs/design.md, "Calibration".
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from time import perf_counter, thread_time
from typing import Callable, Hashable

import torch

log = logging.getLogger("specserve.engine")
PREFILL_ROWS = 64  # rows of the draft pass that prices a draft prefill position
SETTLED_SHARE = 0.8  # a timed pass whose thread ran less of its wall time than this was disturbed
CALIBRATION_PATIENCE_S = 20.0  # how long the start-up calibration re-times disturbed passes


def calibrate(cost, runner, draft_runner, cap: int, prefix_len: int = 32,
              repeats: int = 3, patience_s: float | None = None,
              seed_if_disturbed: bool = True,
              interrupted: Callable[[], bool] | None = None) -> dict:
    """Seed `cost` (the engine's CostModel) from timed passes, so the first rounds already
    know this machine: target passes over k + 1 rows for k = 0..cap, and one draft-model step
    (`draft_runner` None: drafting is free). The calibration fixes the shape of cost against
    k for the engine's life, so it is taken with care: every pass is timed `repeats` times,
    all of them in turn round after round (drift hits each alike), and the median kept;
    disturbed passes are timed again for up to `patience_s` seconds (default
    `CALIBRATION_PATIENCE_S`; see the module doc), and if some stayed disturbed the cost
    model is seeded only if `seed_if_disturbed`; `interrupted()` True between two passes
    stops it (counted as disturbed). Uses pools of its own blocks; returns what it measured,
    with `disturbed`."""
    if patience_s is None:
        patience_s = CALIBRATION_PATIENCE_S
    with pass_timer(runner, prefix_len) as time_target, \
            (pass_timer(draft_runner, prefix_len) if draft_runner else nullcontext()) as time_draft:
        timers = {k: partial(time_target, k) for k in range(cap + 1)}
        if time_draft is not None:
            timers["draft"] = partial(time_draft, 0)
            # a draft pass over PREFILL_ROWS rows: its seconds per position price a draft start
            timers["draft_prefill"] = partial(time_draft, PREFILL_ROWS - 1)
        medians, disturbed = settled_medians(timers, repeats, patience_s, interrupted)
    draft_step = medians.pop("draft", 0.0)
    prefill = medians.pop("draft_prefill", None)
    per_position = prefill / PREFILL_ROWS if prefill is not None else None
    if medians and (seed_if_disturbed or not disturbed):  # an interrupted run measured nothing
        cost.seed(draft_step, medians, per_position)
    return {"draft_step_s": draft_step, "verify_s": medians, "draft_prefill_s": per_position,
            "disturbed": disturbed}


class Calibration:
    """The cost model's start-up timed passes (`run`); if other work on the machine disturbed
    them, `pending` stays True and `retry` runs them again (no patience; `interrupted()`
    stops them) at the engine's idle moments until they run undisturbed."""

    def __init__(self, cost, runner, draft_runner, cap: int) -> None:
        self.cost, self.runner, self.draft_runner, self.cap = cost, runner, draft_runner, cap
        self.pending = False
        self.measured: dict | None = None  # what the last run measured

    def run(self) -> dict:
        self.measured = calibrate(self.cost, self.runner, self.draft_runner, self.cap)
        if self.measured["disturbed"]:
            log.warning("other work on this machine disturbed the cost model's timed passes: "
                        "they run again when the engine is next idle")
            self.pending = True
        return self.measured

    def retry(self, interrupted: Callable[[], bool]) -> bool:
        """True (and the cost model seeded anew) if the passes ran undisturbed."""
        measured = calibrate(self.cost, self.runner, self.draft_runner, self.cap,
                             patience_s=0.0, seed_if_disturbed=False, interrupted=interrupted)
        if not measured["disturbed"]:
            log.info("the cost model's timed passes ran undisturbed this time: seeded anew")
            self.pending = False
        return not self.pending


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
    try:
        yield time_pass
    finally:
        blocks.free(table)  # and with it any per-sequence state the model keeps


def median_round_robin(timers: dict[Hashable, Callable[[], float]], repeats: int
                       ) -> dict[Hashable, float]:
    """Median of `repeats` calls of each timer (a function returning seconds), called in turn
    round after round, so a machine that drifts meanwhile skews them alike."""
    return settled_medians(timers, repeats, 0.0)[0]


def settled_medians(timers: dict[Hashable, Callable[[], float]], repeats: int,
                    patience_s: float, interrupted: Callable[[], bool] | None = None
                    ) -> tuple[dict[Hashable, float], bool]:
    """(medians, disturbed): `median_round_robin`, re-timing disturbed calls. A call during
    which this thread ran less than `SETTLED_SHARE` of the wall time was disturbed; the
    timers short of `repeats` settled calls are called again in further rounds while
    `patience_s` lasts. If every timer then has its settled calls, their medians are kept;
    otherwise every call counts (the medians of a busy machine) and `disturbed` is True.
    `interrupted()` True before a call: ({}, True) at once."""
    settled: dict[Hashable, list[float]] = {key: [] for key in timers}
    every: dict[Hashable, list[float]] = {key: [] for key in timers}
    deadline = time.monotonic() + patience_s
    for round_ in itertools.count():
        for key, timer in timers.items():
            if round_ >= repeats and len(settled[key]) >= repeats:
                continue
            if interrupted is not None and interrupted():
                return {}, True
            wall, ran = perf_counter(), thread_time()
            seconds = timer()
            share = (thread_time() - ran) / max(perf_counter() - wall, 1e-12)
            every[key].append(seconds)
            if share >= SETTLED_SHARE:
                settled[key].append(seconds)
        done = all(len(v) >= repeats for v in settled.values())
        if round_ + 1 >= repeats and (done or time.monotonic() >= deadline):
            break
    samples = settled if done else every
    return {key: statistics.median(v) for key, v in samples.items()}, not done
