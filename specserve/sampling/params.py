"""Per-request sampling parameters, with the names and defaults of vLLM and the OpenAI API.

`SamplingParams` is frozen: a request's parameters never change after it is admitted.
Every value a user can get wrong is checked in `__post_init__`, which raises a
`ValueError` whose message starts with the field's name (e.g. "top_p must be in (0, 1],
got 0"), so the HTTP layer can turn it into a 400 as it is.

A few inputs are normalised rather than rejected, as the OpenAI API allows them:
`top_k=0` means "disabled" like `-1`; `stop` may be one string, a list or None;
`stop_token_ids` may be a list or None; ints are accepted (and stored as floats) for float
fields. Integral floats are *not* accepted where an int is required (`n=1.0` is an error),
and bools are rejected everywhere but the two bool fields, which accept only real bools
(`"no"` and `1` are errors). `seed` must fit in an int64, [-2**63, 2**63), as in the OpenAI
API: the engine seeds completion i of a request with `seed + i` in a generator that takes
[-2**63, 2**64), so every accepted seed is usable.

Each field is declared with `option(default, help)` (see `specserve.options`), which is also
its `generate` flag.

`require_int`, `require_real` and `require_bool` are the checks every config of the
package uses (`SpeculativeConfig`, the `LLM` constructor's arguments), so all of them word
their errors the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from specserve.options import option
from specserve.sampling.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # the OpenAI API's limit for `logprobs` / `top_logprobs`
# Temperatures below this are greedy (as in vLLM): dividing float32 logits by them would
# overflow, and the distribution is a one-hot in all but name anyway.
GREEDY_TEMPERATURE = 1e-5
PENALTY_RANGE = 2.0  # presence and frequency penalties live in [-2, 2]
SEED_LIMIT = 2**63  # seeds live in [-2**63, 2**63): an int64, as in the OpenAI API
MAX_STOP_STRINGS = 16  # stop strings per request
# Per-step work a request sets: the top-k filter and the entropy gates take the k largest
# probabilities of each verified row, every step; beyond these every batch would pay for one
# request's choice
MAX_TOP_K = 1024
MAX_ENTROPY_TOP_K = 64  # the k of `tv_entropy_top_k` and `fly_top_k`
MAX_STOP_CHARS = 256  # characters per stop string
FLY_VARIANTS = ("specserve", "published")  # see sampling/fly.py
PUBLISHED_FLY_WINDOW = 6  # the win_len of FLy's published configuration


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to turn one request's logits into tokens, and when to stop.

    `temperature=0` (or below `GREEDY_TEMPERATURE`, or `top_k=1`) is greedy decoding; see
    `greedy`. `tv_budget` overrides the engine's mentored-decoding budget D for this
    request (None: use the engine's); `tv_entropy_top_k` = k spends it where the target is
    uncertain, D_i = D * h_k(p_i) (see `sampling/entropy.py`; None: D at every position).
    `fly_window` = W turns on FLy verification for this request (see `sampling/fly.py`;
    None: off), with `fly_entropy_threshold` tau and `fly_top_k` for its entropy gate;
    `fly_variant="published"` turns on FLy as its authors' code runs it, `fly_window` then
    being its win_len (default `PUBLISHED_FLY_WINDOW`).
    """

    n: int = option(1, "completions per prompt")
    temperature: float = option(1.0, "0 = greedy")
    top_k: int = option(-1, f"keep the k most likely tokens (-1 or 0: disabled; at most "
                        f"{MAX_TOP_K})")
    top_p: float = option(1.0, "keep the smallest set of tokens whose probability reaches p")
    min_p: float = option(0.0, "drop tokens below min_p times the most likely one's probability")
    repetition_penalty: float = option(1.0, "divide the logits of tokens already seen (> 1)")
    presence_penalty: float = option(0.0, "subtract from the logits of tokens already generated")
    frequency_penalty: float = option(0.0, "subtract, per occurrence, from generated tokens' "
                                      "logits")
    seed: int | None = option(None, "the request's random seed")
    max_tokens: int | None = option(16, "the most tokens to generate")
    stop: tuple[str, ...] = option((), "stop string (repeatable)")
    stop_token_ids: tuple[int, ...] = option((), "token ids that stop the generation",
                                             nargs="*")
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token")
    logprobs: int | None = option(None, "the log-probabilities of this many most likely tokens")
    tv_budget: float | None = option(None, "this request's mentored decoding budget D")
    include_stop_str_in_output: bool = option(False, "keep the stop string in the text")
    tv_entropy_top_k: int | None = option(
        None, "spend the mentored budget where the target is uncertain: D_i = D * h_k(p_i), "
        "the normalized entropy of its top k (None: D at every position)")
    fly_window: int | None = option(None, "FLy verification: defer a rejection when the next "
                                    "this many native verdicts agree (None: off)")
    fly_entropy_threshold: float = option(0.3, "FLy: the target's top-k entropy from which a "
                                          "rejection may be deferred, in [0, 1]")
    fly_top_k: int = option(3, "FLy: the k of its entropy gate and of the draft's rank (>= 2)")
    fly_variant: str = option("specserve", "FLy: 'specserve' (ours, on when fly_window is set) "
                              "or 'published' (the authors' code: on by itself, fly_window its "
                              "win_len, default 6, the threshold in nats)",
                              choices=FLY_VARIANTS)
    structured_outputs: StructuredOutputsParams | None = option(
        None, "what the output must match: a JSON schema, any JSON object, a regex, a choice "
        "or text around JSON values (see `sampling/structured.py`)", cli=False)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        self._check_misc()
        self._check_lossy()

    @property
    def greedy(self) -> bool:
        """True when the processed distribution is a one-hot at the argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _check_counts(self) -> None:
        self._set("n", require_int("n", self.n, minimum=1))
        if self.max_tokens is not None:
            self._set("max_tokens", require_int("max_tokens", self.max_tokens, minimum=1))
        if self.logprobs is not None:
            self._set("logprobs", require_int("logprobs", self.logprobs, minimum=0,
                                              maximum=MAX_LOGPROBS))
        if self.seed is not None:
            require_int("seed", self.seed)
            if not -SEED_LIMIT <= self.seed < SEED_LIMIT:
                raise ValueError(f"seed must fit in an int64, [-2**63, 2**63), got {self.seed!r}")
            self._set("seed", int(self.seed))

    def _check_distribution(self) -> None:
        temperature = require_real("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        self._set("temperature", temperature)
        self._set("top_k", require_int("top_k", self.top_k, maximum=MAX_TOP_K))
        if self.top_k == 0:
            self._set("top_k", -1)
        elif self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (or 0) to disable, or >= 1, got {self.top_k!r}")
        top_p = require_real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self._set("top_p", top_p)
        min_p = require_real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self._set("min_p", min_p)

    def _check_penalties(self) -> None:
        repetition = require_real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(repetition) and repetition > 0):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}"
            )
        self._set("repetition_penalty", repetition)
        for name in ("presence_penalty", "frequency_penalty"):
            value = require_real(name, getattr(self, name))
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ValueError(
                    f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                    f"got {getattr(self, name)!r}"
                )
            self._set(name, value)

    def _check_stops(self) -> None:
        stop = _as_tuple("stop", self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for entry in stop:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"stop entries must be non-empty strings, got {entry!r}")
            if len(entry) > MAX_STOP_CHARS:
                raise ValueError(f"stop entries must be at most {MAX_STOP_CHARS} characters, "
                                 f"got one of {len(entry)}")
            if not entry.isascii() and any("\ud800" <= c <= "\udfff" for c in entry):
                raise ValueError(f"stop entries must be valid Unicode (no lone surrogates), "
                                 f"got {entry!r}")
        self._set("stop", stop)
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        for token in stop_token_ids:
            require_int("stop_token_ids", token, minimum=0)
        self._set("stop_token_ids", tuple(int(token) for token in stop_token_ids))

    def _check_misc(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output"):
            require_bool(name, getattr(self, name))
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.tv_budget is not None:
            budget = require_real("tv_budget", self.tv_budget)
            if not 0 <= budget <= 1:
                raise ValueError(f"tv_budget must be in [0, 1], got {self.tv_budget!r}")
            self._set("tv_budget", budget)

    def _check_lossy(self) -> None:
        if self.tv_entropy_top_k is not None:
            self._set("tv_entropy_top_k", require_int("tv_entropy_top_k", self.tv_entropy_top_k,
                                                      minimum=2, maximum=MAX_ENTROPY_TOP_K))
        window = self.fly_window
        if window is None and self.fly_variant == "published":
            window = PUBLISHED_FLY_WINDOW  # the published variant is on by itself
        checked, tau, top_k, variant = check_fly("fly", 1 if window is None else window,
                                                 self.fly_entropy_threshold, self.fly_top_k,
                                                 self.fly_variant)
        self._set("fly_window", None if window is None else checked)
        self._set("fly_entropy_threshold", tau)
        self._set("fly_top_k", top_k)
        self._set("fly_variant", variant)


def check_fly(prefix: str, window: object, entropy_threshold: object, top_k: object,
              variant: object = "specserve") -> tuple[int, float, int, str]:
    """FLy's settings, checked: window >= 1, top-k in [2, MAX_ENTROPY_TOP_K], the variant one
    of `FLY_VARIANTS`, the entropy threshold in [0, 1] ("specserve", normalized) or [0, log
    top_k] ("published",
    nats) (the errors name `{prefix}_window`, `{prefix}_entropy_threshold`, ...)."""
    if variant not in FLY_VARIANTS:
        raise ValueError(f"{prefix}_variant must be one of {list(FLY_VARIANTS)}, got {variant!r}")
    window = require_int(f"{prefix}_window", window, minimum=1)
    tau = require_real(f"{prefix}_entropy_threshold", entropy_threshold)
    top_k = require_int(f"{prefix}_top_k", top_k, minimum=2, maximum=MAX_ENTROPY_TOP_K)
    high = math.log(top_k) if variant == "published" else 1.0
    if not 0.0 <= tau <= high:  # also rejects NaN
        unit = f"log({top_k}) = {high:.4f} nats" if variant == "published" else "1"
        raise ValueError(f"{prefix}_entropy_threshold must be in [0, {unit}], "
                         f"got {entropy_threshold!r}")
    return window, tau, top_k, variant


def require_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return `value` as an int; raise unless it is an int (bools, floats and strings
    rejected) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return int(value)


def require_real(name: str, value: object) -> float:
    """Return `value` as a float; raise unless it is a real number (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def require_bool(name: str, value: object) -> bool:
    """Return `value`; raise unless it is a real bool (not "no", not 1)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false (a bool), got {value!r}")
    return value


def _as_tuple(name: str, value: object) -> tuple:
    """None → (), one string → (string,), a list or tuple → tuple of its items."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return tuple(value)
