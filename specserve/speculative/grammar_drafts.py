"""The grammar as a drafting source: what a structured request's grammar forces next.

Where a grammar leaves one continuation (a schema's keys and punctuation, `{"name": "`,
closing brackets, a forced function name), its tokens are drafts that cost no draft model.
The controller offers them first in a round and continues after them with the lookup
source (a forced key, then a value copied from the prompt). A token that is the only legal
one survives with probability 1; a forced *string* is tokenized canonically, which the model
almost always follows, so its survival is measured (`ForcedSurvival`) rather than assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAMMAR = "grammar"  # the source's name in metrics
PRIOR_SURVIVAL = 0.95  # per-token survival of a forced token before any has been verified
EMA = 0.05  # weight of each verified forced token in the running survival


@dataclass(slots=True)
class ForcedSurvival:
    """The running share of forced draft tokens the verifier kept (engine-wide)."""

    alpha: float = PRIOR_SURVIVAL

    def survival(self, n: int) -> list[float]:
        """P(the first i forced tokens all survive), i = 1..n."""
        out, reach = [], 1.0
        for _ in range(n):
            reach *= self.alpha
            out.append(reach)
        return out

    def observe(self, verified: int, accepted: int) -> None:
        """`verified` forced tokens reached the verifier; the first `accepted` were kept."""
        for i in range(verified):
            kept = 1.0 if i < accepted else 0.0
            self.alpha += EMA * (kept - self.alpha)
            if not kept:
                return  # positions after a rejection were never judged

