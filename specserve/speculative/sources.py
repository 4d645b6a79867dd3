"""Which drafters each speculative method uses: one table, `SOURCES`, keyed by method.

Each entry lists drafter classes (`drafter.Drafter`), in the order the controller asks the free
ones (a grammar's forced tokens first, then the lookup continuing after them); each builds
itself from the config (`Drafter.build`, None where the config leaves it out: the draft model
of `hybrid` without `model`, the grammar's drafts with `grammar_drafts` false). Adding a
drafter is a file with its `Drafter` subclass and its class in the entries that use it.
"""

from __future__ import annotations

from specserve.speculative.calibration import Calibration
from specserve.speculative.controller import SpeculationController
from specserve.speculative.cost_model import CostModel
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.drafter import BuildContext
from specserve.speculative.grammar_drafts import GrammarDrafter
from specserve.speculative.mtp import MTPDrafter
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.suffix import SuffixDrafter

SOURCES = {
    "hybrid": (GrammarDrafter, SuffixDrafter, DraftModelDrafter),  # a model where one is named
    "suffix": (GrammarDrafter, SuffixDrafter),
    "ngram": (GrammarDrafter, NgramDrafter),
    "draft_model": (GrammarDrafter, DraftModelDrafter),
    "grammar": (GrammarDrafter,),
    "mtp": (GrammarDrafter, MTPDrafter),
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
    ctx = BuildContext(draft_runner, target_vocab, max_prefill_tokens, prefix_caching, runner,
                       head_keep)
    drafters = [d for cls in SOURCES[config.method] if (d := cls.build(config, ctx)) is not None]
    cost = CostModel()
    cap = config.max_k if config.num_speculative_tokens == -1 else config.num_speculative_tokens
    calibration = None
    if runner is not None and config.policy_name == "cost_aware" and cap > 0:
        in_step = any(d.in_step for d in drafters)
        calibration = Calibration(cost, runner, draft_runner if in_step else None, cap)
    return SpeculationController(config, cost, drafters, max_model_len, calibration)
