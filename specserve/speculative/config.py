"""Speculative decoding configuration, in vLLM's shape.

Every field is type- and range-checked in `__post_init__`, before any model loads, with a
`ValueError` whose message starts with the field's name: ints must be ints (not `2.5`, `"8"`
or `True`), the bool must be a bool (not `"no"`), `tv_budget` a number in [0, 1], and the
cross-field rules (`prompt_lookup_min <= prompt_lookup_max`, a draft model for
`draft_model`) are checked here too, so a config that constructs never fails later.

Methods: `hybrid` (the default pair's: suffix drafting and, when `model` names one, a draft
model, chosen per sequence and round by the speculation controller), `suffix` (suffix
drafting over the request and earlier requests' outputs), `draft_model`, `ngram` (prompt
lookup over the request), `grammar` (only the tokens a structured output's grammar forces;
the others draft them too unless `grammar_drafts` is false), `mtp` (the target's own
multi-token-prediction head, where its checkpoint carries one). `suffix_cache_tokens` bounds the
earlier outputs the suffix source keeps (0: this request only). `draft_vocab_size`: the draft model's head scores only the
lowest this many token ids and the added (special) tokens, a cheaper draft step (see
`draft_head.py`; None: the whole vocabulary). `max_k` None: 16 for the lookup-led methods (a long match drafts
long), 8 for `draft_model`.

`draft_weights` None: the draft loads in the target's weight format, except that what would
load int4 loads int4-all (see `weights/loader.py`: a cheaper draft step, acceptance level).

`prefill_window`: when a sequence's draft model starts (deferred until its policy first
wants to draft: see `draft_model`), it is fed at most the newest `prefill_window` tokens of
the context (None: all of them), which bounds what starting the drafter costs.

Each field is declared with `option(default, help, ...)` (see `specserve.options`); that
declaration is also its command-line flag on `generate` and `serve` (laid over
`--speculative-config`), so a new field is one line here plus its check in `__post_init__`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specserve.options import option
from specserve.weights.loader import DTYPES
from specserve.weights.quant import FORMATS
from specserve.sampling.params import require_bool, require_int, require_real
from specserve.speculative.draft_model import DEFAULT_PREFILL_WINDOW
from specserve.speculative.suffix import DEFAULT_CACHE_TOKENS

DEFAULT_DRAFT_VOCAB = 65536  # the draft head's kept ids (see `draft_head.py`)

METHODS = ("hybrid", "suffix", "draft_model", "ngram", "grammar", "mtp")
POLICIES = ("fixed", "acceptance_rate", "accepted_length", "heuristic", "cost_aware")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`num_speculative_tokens=-1` (the default) lets the controller choose the source and k
    per round (0..max_k); a k ≥ 0 fixes it."""

    method: str = option("hybrid", "the drafting method", choices=METHODS,
                         flag="--speculative-method")
    model: str | None = option(None, "the draft model: alias, GGUF file, HF directory or Hub "
                               "id org/repo[:QUANT] (implies method draft_model)",
                               flag="--draft-model")
    num_speculative_tokens: int = option(-1, "k, the tokens drafted per round; -1 lets the "
                                         "controller choose the source and k per round",
                                         short="-k")
    tv_budget: float = option(0.0, "mentored decoding budget D in [0, 1] (0: lossless)")
    bonus_token: bool = option(True, "sample the bonus token when every draft is accepted")
    draft_policy: str | None = option(None, "how k is chosen per round (default: fixed, or "
                                      "cost_aware when k is -1)", choices=POLICIES)
    max_k: int | None = option(None, "upper bound on k for the adaptive policies (default: "
                               "16 for the lookup-led methods, 8 for draft_model)")
    prompt_lookup_max: int = option(4, "ngram: the longest suffix looked up in the context")
    prompt_lookup_min: int = option(1, "ngram: the shortest suffix looked up in the context")
    disable_by_batch_size: int | None = option(
        None, "draft nothing while this many or more sequences are running")
    draft_dtype: str | None = option(None, "the draft's dtype (default: the target's)",
                                     choices=DTYPES)
    draft_weights: str | None = option(
        None, "the draft's weight format (default: the target's, with int4 as int4-all: "
        "every projection and the head at 4 bits)", choices=FORMATS)
    prefill_window: int | None = option(
        DEFAULT_PREFILL_WINDOW, "newest context tokens a starting draft is fed")
    suffix_cache_tokens: int = option(
        DEFAULT_CACHE_TOKENS, "tokens of earlier outputs kept for suffix drafting (0: this "
        "request only)")
    draft_vocab_size: int | None = option(
        DEFAULT_DRAFT_VOCAB, "the draft head scores only the lowest this many token ids and "
        "the added tokens (None: the whole vocabulary)")
    grammar_drafts: bool = option(True, "draft the tokens a structured output's grammar "
                                  "forces (method grammar: those alone)")

    def __post_init__(self) -> None:
        self._check_method()
        self._set("num_speculative_tokens",
                  check_num_speculative_tokens("num_speculative_tokens",
                                               self.num_speculative_tokens))
        budget = require_real("tv_budget", self.tv_budget)
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"tv_budget must be in [0, 1], got {self.tv_budget!r}")
        self._set("tv_budget", budget)
        require_bool("bonus_token", self.bonus_token)
        require_bool("grammar_drafts", self.grammar_drafts)
        if self.method == "grammar" and not self.grammar_drafts:
            raise ValueError("grammar_drafts must be true for method 'grammar'")
        _check_choice("draft_policy", self.draft_policy, POLICIES)
        max_k = (8 if self.method == "draft_model" else MAX_SPECULATIVE_TOKENS) \
            if self.max_k is None else self.max_k
        self._set("max_k", require_int("max_k", max_k, minimum=1,
                                       maximum=MAX_SPECULATIVE_TOKENS))
        self._set("suffix_cache_tokens", require_int("suffix_cache_tokens",
                                                     self.suffix_cache_tokens, minimum=0))
        if self.draft_vocab_size is not None:
            self._set("draft_vocab_size", require_int("draft_vocab_size", self.draft_vocab_size,
                                                      minimum=1))
        self._check_lookup()
        if self.disable_by_batch_size is not None:
            self._set("disable_by_batch_size",
                      require_int("disable_by_batch_size", self.disable_by_batch_size, minimum=1))
        _check_choice("draft_dtype", self.draft_dtype, tuple(DTYPES))
        _check_choice("draft_weights", self.draft_weights, FORMATS)
        if self.prefill_window is not None:
            self._set("prefill_window", require_int("prefill_window", self.prefill_window,
                                                    minimum=1))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _check_method(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        model = self.model
        if model is not None:
            if isinstance(model, os.PathLike):
                model = os.fspath(model)
            if not isinstance(model, str) or not model.strip():
                raise ValueError(f"model must be a model name or path (a non-empty string), "
                                 f"got {self.model!r}")
            self._set("model", model)
        if self.method == "draft_model" and model is None:
            raise ValueError("model must name the draft model for method 'draft_model'")

    def _check_lookup(self) -> None:
        high = require_int("prompt_lookup_max", self.prompt_lookup_max, minimum=1)
        low = require_int("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        self._set("prompt_lookup_max", high)
        self._set("prompt_lookup_min", low)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model" or (self.method == "hybrid" and self.model is not None)

    @property
    def policy_name(self) -> str:
        if self.draft_policy is not None:
            return self.draft_policy
        return "cost_aware" if self.num_speculative_tokens == -1 else "fixed"

    @staticmethod
    def from_dict(d: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """None, a config (returned as is) or a dict of its fields; anything else is an error."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (or a SpeculativeConfig), "
                             f"got {type(d).__name__}: {d!r}")
        known = set(SpeculativeConfig.__dataclass_fields__)
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(map(str, unknown))}; "
                             f"known: {sorted(known)}")
        return SpeculativeConfig(**d)


def check_num_speculative_tokens(name: str, k: object) -> int:
    """k as an int: -1 (adaptive) or 0..MAX_SPECULATIVE_TOKENS; ValueError naming `name`. The
    one check of k, for the engine's config and for a request's override alike."""
    k = require_int(name, k)
    if not (k == -1 or 0 <= k <= MAX_SPECULATIVE_TOKENS):
        raise ValueError(f"{name} must be -1 (adaptive) or 0..{MAX_SPECULATIVE_TOKENS}, "
                         f"got {k!r}")
    return k


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """None passes (the field's default applies); otherwise `value` must be one of `choices`."""
    if value is not None and (not isinstance(value, str) or value not in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
