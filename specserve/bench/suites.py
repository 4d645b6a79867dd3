"""Named benchmark suites: lists of configurations over workloads.

A configuration is a name, an optional speculative config (None = target only) and a
temperature; the runner crosses it with workloads, seeds and repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("code_edit", "creative", "summarize", "chat_short")
SESSIONS = ("agent_session", "code_revision_chat")


def uses_draft(spec: dict) -> bool:
    """Whether a speculative config (without its "model") drafts with the draft model."""
    return spec.get("method", "hybrid") in ("draft_model", "hybrid")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    spec: dict | None = None  # speculative_config without "model" (the runner adds the draft)
    temperature: float = 0.0
    workloads: tuple[str, ...] = ("creative",)

    @property
    def label(self) -> str:
        return f"{self.name} @T={self.temperature:g}"


def _draft(k: int, **kw) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": k, **kw}


def seed_table(bonus: bool = True) -> list[BenchConfig]:
    """The seed's break-even table: creative writing at T = 0.7."""
    rows = [("fixed 4, TV=1", _draft(4, tv_budget=1.0)), ("fixed 6, TV=1", _draft(6, tv_budget=1.0)),
            ("fixed 8, TV=1", _draft(8, tv_budget=1.0)), ("fixed 8, TV=0.75", _draft(8, tv_budget=0.75)),
            ("fixed 8, TV=0.5", _draft(8, tv_budget=0.5)), ("fixed 4, TV=0 (lossless)", _draft(4)),
            ("cost-aware, TV=0", _draft(-1))]
    configs = [BenchConfig("target only", None, 0.7)]
    for name, spec in rows:
        configs.append(BenchConfig(name, spec, 0.7))
        if bonus:
            configs.append(BenchConfig(name + ", no bonus", dict(spec, bonus_token=False), 0.7))
    return configs


def policies() -> list[BenchConfig]:
    """The seed author's policy table: code and creative, greedy."""
    w = ("code_edit", "creative")
    return [BenchConfig("target only", None, 0.0, w),
            BenchConfig("fixed 4", _draft(4), 0.0, w),
            BenchConfig("acceptance_rate", _draft(4, draft_policy="acceptance_rate"), 0.0, w),
            BenchConfig("accepted_length", _draft(4, draft_policy="accepted_length"), 0.0, w),
            BenchConfig("heuristic", _draft(4, draft_policy="heuristic"), 0.0, w),
            BenchConfig("cost_aware", _draft(-1), 0.0, w)]


def ngram() -> list[BenchConfig]:
    w = WORKLOADS
    return [BenchConfig("target only", None, 0.0, w),
            BenchConfig("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4}, 0.0, w),
            BenchConfig("ngram cost-aware", {"method": "ngram", "num_speculative_tokens": -1}, 0.0, w)]


def draft_k() -> list[BenchConfig]:
    """Target-only vs draft model at k = 2, 4, 8, greedy and T = 0.7, code and creative."""
    w = ("code_edit", "creative")
    out = []
    for t in (0.0, 0.7):
        out.append(BenchConfig("target only", None, t, w))
        out += [BenchConfig(f"fixed {k}", _draft(k), t, w) for k in (2, 4, 8)]
    return out


def drafting() -> list[BenchConfig]:
    """Every drafting source alone and the hybrid default, on every workload and session,
    greedy and (creative) T = 0.7; the sessions also without the cache of earlier outputs."""
    w = WORKLOADS + SESSIONS
    adaptive = {"num_speculative_tokens": -1}
    sources = [("ngram", {"method": "ngram", **adaptive}), ("suffix", {"method": "suffix", **adaptive}),
               ("draft model", {"method": "draft_model", **adaptive}),
               ("hybrid (default)", {"method": "hybrid", **adaptive})]
    out = [BenchConfig("target only", None, 0.0, w)]
    out += [BenchConfig(name, spec, 0.0, w) for name, spec in sources]
    out.append(BenchConfig("hybrid, no earlier outputs", {"method": "hybrid", **adaptive,
                                                           "suffix_cache_tokens": 0}, 0.0, SESSIONS))
    out.append(BenchConfig("target only", None, 0.7, ("creative",)))
    out += [BenchConfig(name, spec, 0.7, ("creative",)) for name, spec in sources]
    return out


SUITES = {"drafting": drafting, "seed-table": seed_table, "policies": policies, "ngram": ngram, "draft-k": draft_k}


def get_suite(name: str) -> list[BenchConfig]:
    if name not in SUITES:
        raise ValueError(f"suite must be one of {sorted(SUITES)}, got {name!r}")
    return SUITES[name]()
