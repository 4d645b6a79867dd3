"""How often lookup drafts survive verification, learned online by match length.

Model: P(accept 1) = min(1, f_first(L) · c_1), P(accept i | i − 1 kept) = min(1, f_next(L) ·
c_i), with c_i the position's vote share and f learned per match-length bucket and origin
(own text / shared cache), f = (accepted + w·prior) / (Σ c tried + w). A position is *tried*
when every draft before it was accepted; survival is the product of the factors. Each request
also keeps its own fit of its short matches (`RequestFit`). Why: docs/design.md, "Lookup
acceptance by match length".
"""

from __future__ import annotations

BUCKET_ENDS = (1, 2, 4, 8, 16)  # bucket b holds L ≤ BUCKET_ENDS[b]; the last holds the rest
FIRST_PRIOR = (0.15, 0.25, 0.4, 0.55, 0.7, 0.8)  # [bucket] prior of f_first
NEXT_PRIOR = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)  # [bucket] prior of f_next
PRIOR_WEIGHT = 4.0  # pseudo-trials behind each prior
REQUEST_WEIGHT = 3.0  # pseudo-accepts behind a request's fit of 1 (the table's own rate)
FIT_MAX_MATCH = BUCKET_ENDS[2]  # matches up to this long are priced with the request's fit


def bucket(match_len: int) -> int:
    """The match-length bucket of L."""
    for b, end in enumerate(BUCKET_ENDS):
        if match_len <= end:
            return b
    return len(BUCKET_ENDS)


class RequestFit:
    """One request's first positions: accepts seen and accepts the table expected."""

    __slots__ = ("accepted", "expected")

    def __init__(self) -> None:
        self.accepted, self.expected = 0.0, 0.0

    def factor(self) -> float:
        """The request's first-position factor relative to the table."""
        return (self.accepted + REQUEST_WEIGHT) / (self.expected + REQUEST_WEIGHT)


NO_FIT = RequestFit()  # factor 1: the table alone (never observed into)


class MatchStats:
    """[origin][bucket] → [Σc tried first, accepted first, Σc tried next, accepted next]."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts = [[[0.0, 0, 0.0, 0] for _ in FIRST_PRIOR] for _ in range(2)]

    def factors(self, match_len: int, from_cache: bool) -> tuple[float, float]:
        """(f_first, f_next) for a match of length `match_len`."""
        b = bucket(match_len)
        tried1, acc1, tried2, acc2 = self._counts[from_cache][b]
        first = (acc1 + PRIOR_WEIGHT * FIRST_PRIOR[b]) / (tried1 + PRIOR_WEIGHT)
        following = (acc2 + PRIOR_WEIGHT * NEXT_PRIOR[b]) / (tried2 + PRIOR_WEIGHT)
        return first, following

    def survival(self, confidence: list[float], match_len: int, from_cache: bool,
                 fit: RequestFit = NO_FIT) -> list[float]:
        """[len(confidence)] P(positions 1..i all accepted), non-increasing (`fit`: the
        request's, scaling the first position of a short match)."""
        first, following = self.factors(match_len, from_cache)
        if match_len <= FIT_MAX_MATCH:
            first *= fit.factor()
        out, reach = [], 1.0
        for i, c in enumerate(confidence):
            reach *= min(1.0, (first if i == 0 else following) * c)
            out.append(reach)
        return out

    def observe(self, confidence: list[float], match_len: int, from_cache: bool,
                num_accepted: int, fit: RequestFit | None = None) -> None:
        """A round verified the first len(confidence) tokens of a lookup draft (`fit`: the
        request's, which learns what a short match's first position did against the table)."""
        if not confidence:
            return
        if fit is not None and match_len <= FIT_MAX_MATCH:
            fit.expected += min(1.0, self.factors(match_len, from_cache)[0] * confidence[0])
            fit.accepted += num_accepted >= 1
        counts = self._counts[from_cache][bucket(match_len)]
        counts[0] += confidence[0]
        counts[1] += num_accepted >= 1
        for i in range(1, min(num_accepted + 1, len(confidence))):  # tried: all before kept
            counts[2] += confidence[i]
            counts[3] += num_accepted > i
