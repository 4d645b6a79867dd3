"""Checks on what a user hands the Python API, run before any model loads or any request is
queued, so a bad value is a `ValueError` naming it and never a half-done call.

- `check_llm_args`: the `LLM` constructor's arguments (model, dtype, weights, sizes, the
  speculative config), checked before the target loads: the configuration tree
  (`specserve.config.LLMConfig`) checks them, `check_draft` the loaded draft.
- `check_generate_inputs`: prompts are a `str` or a list of `int` token ids (or a list of
  those); nothing else is taken for a prompt: `bytes`, bools, floats, numpy arrays and
  tuples are refused instead of being read as token ids. Strings must be valid Unicode.
- `check_conversations`: one conversation (a list of message dicts) or a list of them; the
  messages themselves are checked against the template's roles by
  `Tokenizer.apply_chat_template`.
"""

from __future__ import annotations

from numbers import Integral

from specserve.config import LLMConfig
from specserve.weights.loader import LoadedModel
from specserve.models.tokenizer import check_text
from specserve.sampling.params import SamplingParams
from specserve.speculative.config import SpeculativeConfig

Prompt = str | list[int]


def check_llm_args(model: object, dtype: object, speculative_config: object, max_num_seqs: object,
                   max_model_len: object, draft: object, weights: object
                   ) -> SpeculativeConfig | None:
    """Validate `LLM(...)`'s arguments without loading anything; return the speculative config."""
    config = LLMConfig.from_kwargs(model, dtype, speculative_config, weights,
                                   max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    check_draft(draft)
    return config.speculative


def check_draft(draft: object) -> None:
    """`LLM(draft=...)`: an already loaded draft model, or None."""
    if draft is not None and not isinstance(draft, LoadedModel):
        raise ValueError(f"draft must be a LoadedModel or None, got {type(draft).__name__}")


def check_generate_inputs(prompts: object, sampling_params: object
                          ) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or a list of prompts, and one SamplingParams or one per prompt (None: the
    defaults); return both as lists of equal length, token ids as plain ints."""
    batch = _prompt_batch(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(batch)
    elif isinstance(sampling_params, list):
        params = sampling_params
        if len(params) != len(batch):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt: "
                             f"got {len(params)} for {len(batch)} prompts")
    else:
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                         f"got {type(sampling_params).__name__}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return batch, list(params)


def check_conversations(messages: object) -> list[list[dict]]:
    """One conversation (a list of dicts) or a list of conversations -> a list of them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of message dicts, or a list of "
                         f"such lists, got {_short(messages)}")
    if all(isinstance(m, dict) for m in messages):
        return [messages]
    if all(isinstance(c, list) for c in messages):
        return messages
    raise ValueError("messages must be a list of message dicts (one conversation) or a list of "
                     f"such lists (several), not a mix: got {_short(messages)}")


def _prompt_batch(prompts: object) -> list[Prompt]:
    if isinstance(prompts, str):
        return [check_text("prompt", prompts)]
    if not isinstance(prompts, list):
        raise ValueError(f"prompts must be a string, a list of int token ids, or a list of "
                         f"those, got {type(prompts).__name__}: {_short(prompts)}")
    if not prompts:
        raise ValueError("prompts is empty: give a string, a list of token ids, or a list of those")
    if all(isinstance(p, (str, list)) for p in prompts):
        return [_one_prompt(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
    return [_token_ids("prompt", prompts)]


def _one_prompt(where: str, prompt: object) -> Prompt:
    if isinstance(prompt, str):
        return check_text(where, prompt)
    return _token_ids(where, prompt)


def _token_ids(where: str, ids: list) -> list[int]:
    if not ids:
        raise ValueError(f"{where} is an empty list of token ids")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise ValueError(f"{where}[{j}] must be an int token id, got {t!r} "
                             "(a prompt is a string or a list of int token ids)")
        if t < 0:
            raise ValueError(f"{where}[{j}] must be a token id >= 0, got {t!r}")
    return [int(t) for t in ids]


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

