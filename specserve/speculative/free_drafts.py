"""The free drafters of a method, one after the other: what a grammar forces next, then the
lookup's candidate continuing after it (cut where the grammar would refuse it).

Free drafters (`Drafter.in_step` False) cost no model pass: they offer their candidates before
the step, and the controller prices them by their survival. A forced drafter's tokens survive
as its running share says (`Drafter.survival`); the lookup's by the acceptance table of its
matches (`MatchStats`, by match length, confidence and where the match came from), scaled by
how well the sequence has copied (`RequestFit`). Each part is learned from only where the
verifier reached it.
"""

from __future__ import annotations

from specserve.sampling.grammar import GrammarError
from specserve.speculative.candidate import NO_CANDIDATE
from specserve.speculative.grammar_drafts import legal_part
from specserve.speculative.match_stats import MatchStats


class FreeDrafts:
    """`drafters`: the method's; the first forced free one and the first other free one are
    used (each optional). The per-sequence state is the controller's (`st`: `forced`, the
    forced tokens; `candidate`, the lookup's; `fit`, `reason`)."""

    def __init__(self, drafters) -> None:
        free = [d for d in drafters if not d.in_step]
        self.forcer = next((d for d in free if d.forced), None)
        self.lookup = next((d for d in free if not d.forced), None)
        self.stats = MatchStats()

    def find(self, seq, st, limit: int) -> int:
        """This round's free drafts of `seq` (at most `limit`), kept in `st`; how many."""
        forcer, lookup, grammar = self.forcer, self.lookup, seq.grammar is not None
        try:
            st.forced = forcer.candidate(seq, limit).tokens \
                if forcer is not None and (grammar or not forcer.needs_mask) else []
            cand = NO_CANDIDATE
            if lookup is not None and limit > len(st.forced) and (grammar or not lookup.needs_mask):
                cand = legal_part(seq, st.forced,
                                  lookup.candidate(seq, limit - len(st.forced), st.forced))
        except GrammarError:  # its grammar cannot go on: the round fails that sequence alone
            st.forced, cand = [], NO_CANDIDATE
        st.candidate = cand
        return len(st.forced) + len(cand.tokens)

    def survival(self, st) -> list[float]:
        """P(the first i of `st`'s free drafts all survive), i = 1..n."""
        survival = self.forcer.survival(len(st.forced)) if st.forced else []
        reach = survival[-1] if survival else 1.0
        cand = st.candidate
        if cand.tokens:
            survival += [reach * p for p in self.stats.survival(
                cand.confidence, cand.match_len, cand.from_cache, st.fit)]
        return survival

    def learn(self, seq, st, k: int, num_accepted: int) -> None:
        """The verifier kept `num_accepted` of the first `k` free drafts: the forced ones
        first, then the lookup's; each part is learned from (and counted) only where the
        verifier reached it."""
        forced = min(len(st.forced), k)
        if forced:
            kept = min(num_accepted, forced)
            self.forcer.learn(forced, kept)
            seq.metrics.record_source(self.forcer.name, forced, kept, st.reason)
        rest, reached = k - forced, num_accepted >= forced
        if rest and reached:
            cand = st.candidate
            self.stats.observe(cand.confidence[:rest], cand.match_len, cand.from_cache,
                               num_accepted - forced, st.fit)
            seq.metrics.record_source(self.lookup.name, rest, num_accepted - forced, st.reason)

    def name(self, st) -> str:
        """The drafters of `st`'s free drafts, in words (`grammar+suffix`)."""
        names = [self.forcer.name] if st.forced else []
        return "+".join(names + ([self.lookup.name] if self.lookup is not None else []))
