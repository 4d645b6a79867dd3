"""Which drafters each speculative method uses: one table, `SOURCES`, keyed by method.

Each entry lists builders, in the order the controller asks the free drafters (a grammar's
forced tokens first, then the lookup continuing after them); a builder returns a `Drafter`
(`drafter.py`) or None where the configuration leaves it out. Adding a drafter is a file with
its `Drafter` subclass and its builder in the entries of the methods that use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.speculative.calibration import Calibration
from specserve.speculative.controller import SpeculationController
from specserve.speculative.cost_model import CostModel
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.drafter import Drafter
from specserve.speculative.grammar_drafts import GrammarDrafter
from specserve.speculative.mtp import MTPDrafter
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.suffix import SuffixCache, SuffixDrafter


@dataclass(frozen=True, slots=True)
class Context:
    """What builders are handed besides the config."""

    draft_runner: object = None  # the draft model's runner (None: no draft model)
    target_vocab: int = 0
    max_prefill_tokens: int = 256
    prefix_caching: bool = True
    runner: object = None  # the target's runner
    head_keep: list[int] | None = None  # the draft tokens a restricted head keeps (specials)


def grammar(config, ctx: Context) -> Drafter | None:
    return GrammarDrafter() if config.grammar_drafts else None


def suffix(config, ctx: Context) -> Drafter:
    cache = SuffixCache(config.suffix_cache_tokens) if config.suffix_cache_tokens else None
    return SuffixDrafter(cache, max_draft=config.max_k)


def ngram(config, ctx: Context) -> Drafter:
    return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)


def draft_model(config, ctx: Context) -> Drafter | None:
    if not config.uses_draft_model:
        return None
    restrict = (config.draft_vocab_size, list(ctx.head_keep)) \
        if config.draft_vocab_size is not None and ctx.head_keep is not None else None
    runner = ctx.draft_runner
    return DraftModelDrafter(runner, runner.block_manager(ctx.prefix_caching), ctx.target_vocab,
                             max_prefill_tokens=ctx.max_prefill_tokens,
                             prefill_window=config.prefill_window, restrict=restrict)


def mtp(config, ctx: Context) -> Drafter:
    return MTPDrafter.of(ctx.runner)


SOURCES = {
    "hybrid": (grammar, suffix, draft_model),  # the draft model where `model` names one
    "suffix": (grammar, suffix),
    "ngram": (grammar, ngram),
    "draft_model": (grammar, draft_model),
    "grammar": (grammar,),
    "mtp": (grammar, mtp),
}


def build_controller(config, draft_runner=None, target_vocab: int = 0,
                     max_prefill_tokens: int = 256, max_model_len: int = 1 << 30,
                     prefix_caching: bool = True, runner=None,
                     head_keep: list[int] | None = None) -> SpeculationController:
    """The controller a SpeculativeConfig asks for, with the drafters of its method
    (`SOURCES`); a draft model drafts through `draft_runner` with a block manager of its own.
    `runner` (the target's): the cost-aware policy's timed passes run on it at start-up;
    `head_keep` (None: the head is left whole): the draft tokens a restricted draft head keeps
    beside the frequent ones (its special tokens), where the config restricts it."""
    ctx = Context(draft_runner, target_vocab, max_prefill_tokens, prefix_caching, runner,
                  head_keep)
    drafters = [d for build in SOURCES[config.method] if (d := build(config, ctx)) is not None]
    cost = CostModel()
    cap = config.max_k if config.num_speculative_tokens == -1 else config.num_speculative_tokens
    calibration = None
    if runner is not None and config.policy_name == "cost_aware" and cap > 0:
        in_step = any(d.in_step for d in drafters)
        calibration = Calibration(cost, runner, draft_runner if in_step else None, cap)
    return SpeculationController(config, cost, drafters, max_model_len, calibration)
