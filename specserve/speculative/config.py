"""Speculative decoding configuration, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_model", "ngram")
POLICIES = ("fixed", "acceptance_rate", "accepted_length", "heuristic", "cost_aware")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`num_speculative_tokens=-1` lets the cost-aware policy choose k per round (0..max_k)."""

    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 4
    tv_budget: float = 0.0
    bonus_token: bool = True
    draft_policy: str | None = None  # None: "fixed", or "cost_aware" when k == -1
    max_k: int = 8  # upper bound for adaptive policies
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    draft_dtype: str | None = None  # None: the target's dtype

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("model must name the draft model for method 'draft_model'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"num_speculative_tokens must be -1 (adaptive) or 0..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not 0.0 <= float(self.tv_budget) <= 1.0:
            raise ValueError(f"tv_budget must be in [0, 1], got {self.tv_budget!r}")
        if self.draft_policy is not None and self.draft_policy not in POLICIES:
            raise ValueError(f"draft_policy must be one of {POLICIES}, got {self.draft_policy!r}")
        if not 1 <= self.max_k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"max_k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.max_k!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size!r}")

    @property
    def policy_name(self) -> str:
        if self.draft_policy is not None:
            return self.draft_policy
        return "cost_aware" if self.num_speculative_tokens == -1 else "fixed"

    @staticmethod
    def from_dict(d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            return d
        known = set(SpeculativeConfig.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return SpeculativeConfig(**d)
