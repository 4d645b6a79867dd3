"""Speculative-decoding counters, per request and per engine.

Per round: `drafted` = k proposed tokens, `accepted` = how many of them the verifier kept,
`emitted` = accepted + the recovered or bonus token. Mean acceptance length is emitted tokens
per round (bonus included), so plain decoding scores 1.0.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

HEALTHY_ACCEPTANCE = 0.6
DEFAULT_WINDOW = 1000


@dataclass
class SpecMetrics:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [max k]
    accepted_per_position: list[int] = field(default_factory=list)  # [max k]
    draft_time: float = 0.0
    verify_time: float = 0.0
    k_histogram: Counter = field(default_factory=Counter)
    tv_sum: float = 0.0  # realised TV(pi, p) summed over verified draft positions
    tv_steps: int = 0
    sources: dict = field(default_factory=dict)  # source → [rounds, drafted, accepted]
    idle: Counter = field(default_factory=Counter)  # why a round drafted nothing → rounds

    def record(self, k: int, accepted: int, emitted: int, tvs: list[float] = ()) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += accepted
        self.emitted += emitted
        self.k_histogram[k] += 1
        grow = k - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(k):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        self.tv_sum += sum(tvs)
        self.tv_steps += len(tvs)

    def record_source(self, source: str | None, k: int, accepted: int, reason: str) -> None:
        """Which source drafted the round (None: none did, for `reason`)."""
        if source is None:
            self.idle[reason] += 1
            return
        counts = self.sources.setdefault(source, [0, 0, 0])
        counts[0] += 1
        counts[1] += k
        counts[2] += accepted

    def merge(self, other: "SpecMetrics") -> None:
        for name in ("rounds", "drafted", "accepted", "emitted", "draft_time", "verify_time",
                     "tv_sum", "tv_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine += [0] * (len(theirs) - len(mine))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.k_histogram.update(other.k_histogram)
        self.idle.update(other.idle)
        for name, counts in other.sources.items():
            mine = self.sources.setdefault(name, [0, 0, 0])
            for i, v in enumerate(counts):
                mine[i] += v

    @property
    def by_source(self) -> dict:
        """Per source: rounds it drafted, tokens drafted and accepted, acceptance rate."""
        return {name: {"rounds": r, "drafted": d, "accepted": a,
                       "acceptance_rate": a / d if d else None}
                for name, (r, d, a) in sorted(self.sources.items())}

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                      self.drafted_per_position)]

    @property
    def mean_tv(self) -> float | None:
        return self.tv_sum / self.tv_steps if self.tv_steps else None

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "emitted": self.emitted, "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_time_s": self.draft_time, "verify_time_s": self.verify_time,
            "k_histogram": dict(sorted(self.k_histogram.items())), "mean_tv": self.mean_tv,
            "by_source": self.by_source, "idle_rounds": dict(sorted(self.idle.items())),
        }

    def summary(self) -> str:
        rate = self.acceptance_rate
        mal = self.mean_acceptance_length
        hist = " ".join(f"{k}:{n}" for k, n in sorted(self.k_histogram.items()))
        return (f"rounds {self.rounds}, drafted {self.drafted}, accepted {self.accepted}"
                f" ({'-' if rate is None else f'{rate:.1%}'}), mean acceptance length "
                f"{'-' if mal is None else f'{mal:.2f}'}, draft {self.draft_time:.2f}s, "
                f"verify {self.verify_time:.2f}s, k histogram [{hist}]")


class RollingWindow:
    """Acceptance over the last `size` rounds, and a health flag (acceptance < 0.6 is unhealthy)."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        self._rounds: deque[tuple[int, int]] = deque(maxlen=size)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._rounds.append((drafted, accepted))

    @property
    def acceptance_rate(self) -> float | None:
        drafted = sum(d for d, _ in self._rounds)
        return sum(a for _, a in self._rounds) / drafted if drafted else None

    @property
    def healthy(self) -> bool:
        rate = self.acceptance_rate
        return rate is None or rate >= HEALTHY_ACCEPTANCE


@dataclass
class EngineMetrics:
    total: SpecMetrics = field(default_factory=SpecMetrics)
    window: RollingWindow = field(default_factory=RollingWindow)

    def as_dict(self) -> dict:
        return {**self.total.as_dict(), "window_acceptance_rate": self.window.acceptance_rate,
                "healthy": self.window.healthy}
