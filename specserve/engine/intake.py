"""Requests in: what a request must be before anything is queued, and its sequences.

`check` raises ValueError naming the field for a request that cannot be served, and returns
the compiled grammar of its structured output (compiled here, thread-safely, or found in the
compiler's cache); `sequence` builds one of its `n` sequences (its seed, its mentored-decoding
budget, its grammar's matcher). Neither touches engine state, so a client may call `check`
on its own thread.
"""

from __future__ import annotations

import random

import torch

from specserve.engine.outputs import SpeculationOverride
from specserve.engine.request import Request
from specserve.engine.sequence import Sequence
from specserve.sampling.grammar import LazyGrammarCompiler
from specserve.sampling.params import SamplingParams


def compiler(tokenizer, vocab_size: int) -> LazyGrammarCompiler:
    """The structured outputs' grammar compiler (built on the first spec it compiles)."""
    return LazyGrammarCompiler(tokenizer, vocab_size)


def check(prompt_ids: list[int], params: SamplingParams,
          speculation: SpeculationOverride | None, max_model_len: int, vocab: int, grammars):
    """Raise ValueError (naming the field) if the request cannot be served; returns the
    compiled grammar of its structured output (None: none)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if speculation is not None and not isinstance(speculation, SpeculationOverride):
        raise ValueError("speculation must be a SpeculationOverride, got "
                         f"{type(speculation).__name__}")
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                         f"{max_model_len} (room for at least one new token needed)")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
           for t in prompt_ids):
        raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
    spec = params.structured_outputs
    return grammars.compile(spec) if spec is not None else None


def sequence(req: Request, index: int, seq_id: int, seeds: random.Random,
             default_budget: float) -> Sequence:
    """The request's `index`-th sequence; `default_budget`: the mentored-decoding budget of a
    request that sets none (its override's, else its sampling parameters')."""
    params = req.params
    seed = params.seed + index if params.seed is not None else seeds.getrandbits(63)
    override = req.speculation
    budget = (override.tv_budget if override is not None and override.tv_budget is not None
              else params.tv_budget if params.tv_budget is not None else default_budget)
    seq = Sequence(seq_id, req.request_id, index, list(req.prompt_ids), params,
                   torch.Generator().manual_seed(seed), budget, arrival=req.arrival,
                   client=req.client)
    if req.grammar is not None:
        seq.grammar = req.grammar.matcher()
    return seq
