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

from specserve.speculative.candidate import NO_CANDIDATE, Candidate
from specserve.speculative.drafter import BuildContext, Drafter

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


class GrammarDrafter(Drafter):
    """The tokens a sequence's grammar forces next (`grammar.forced`), as a free drafter whose
    candidates come first; raises `GrammarError` where the grammar cannot go on."""

    name, forced, needs_mask = GRAMMAR, True, True

    def __init__(self) -> None:
        self.running = ForcedSurvival()

    @classmethod
    def build(cls, config, ctx: BuildContext) -> GrammarDrafter | None:
        return cls() if config.grammar_drafts else None

    def candidate(self, seq, limit: int, extra: list[int] = ()) -> Candidate:
        tokens = seq.grammar.forced(limit)
        return Candidate(tokens, [1.0] * len(tokens), len(tokens)) if tokens else NO_CANDIDATE

    def survival(self, n: int) -> list[float]:
        return self.running.survival(n)

    def learn(self, verified: int, accepted: int) -> None:
        self.running.observe(verified, accepted)


def legal_part(seq, before: list[int], cand: Candidate) -> Candidate:
    """`cand` (drafted after `before`) cut where the sequence's grammar would refuse it;
    raises `GrammarError` where the grammar cannot go on."""
    if seq.grammar is None or not cand.tokens:
        return cand
    legal = seq.grammar.legal_prefix(list(before) + cand.tokens) - len(before)
    return Candidate(cand.tokens[:legal], cand.confidence[:legal], cand.match_len,
                     cand.from_cache) if legal > 0 else NO_CANDIDATE
