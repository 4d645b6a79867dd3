"""Start-up calibration of the engine's cost model from timed passes on this machine."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING

from specserve.engine.runner import median_round_robin

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine

PREFILL_ROWS = 64  # rows of the draft pass that prices a draft prefill position


def calibrate(engine: "LLMEngine", prefix_len: int = 32, repeats: int = 3) -> dict:
    """Seed the engine's cost model from timed passes, so a cost-aware policy's first rounds
    already know this machine: target passes over k + 1 rows for k = 0..cap, and one draft
    model step (a drafter without a model drafts for free). The calibration fixes the
    shape of cost against k for the engine's life, so it is taken with care: every pass is
    timed `repeats` times, all of them in turn round after round (drift hits each alike),
    and the median kept. Needs a free slot in each cache; returns what it measured."""
    spec = engine.spec
    cap = spec.max_k if spec.num_speculative_tokens == -1 else spec.num_speculative_tokens
    draft_runner = getattr(engine.drafter, "runner", None)
    with engine.runner.pass_timer(prefix_len) as time_target, \
            (draft_runner.pass_timer(prefix_len) if draft_runner else nullcontext()) as time_draft:
        timers = {k: partial(time_target, k) for k in range(cap + 1)}
        if time_draft is not None:
            timers["draft"] = partial(time_draft, 0)
            # a draft pass over PREFILL_ROWS rows: its seconds per position price a draft start
            timers["draft_prefill"] = partial(time_draft, PREFILL_ROWS - 1)
        medians = median_round_robin(timers, repeats)
    draft_step = medians.pop("draft", 0.0)
    prefill = medians.pop("draft_prefill", None)
    per_position = prefill / PREFILL_ROWS if prefill is not None else None
    engine.cost.seed(draft_step, medians, per_position)
    return {"draft_step_s": draft_step, "verify_s": medians, "draft_prefill_s": per_position}
