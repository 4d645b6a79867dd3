"""Paired statistics for comparing a configuration with target-only decoding on the same
items: what a reviewer asks of an accuracy or speed claim.

The unit is the item (a task or a HumanEval problem), never the call: calls of one item are
not independent, and a deterministic configuration's seeds repeat one output. Each
configuration's score on an item is the mean of its calls' outcomes there (0 or 1 when it has
one distinct outcome).

- `mcnemar_exact(b, c)`: the exact McNemar test on b + c discordant items (binomial, p = 1/2,
  two-sided: twice the smaller tail, at most 1).
- `newcombe_paired(a, b, c, d)`: Newcombe's square-and-add (hybrid score) interval for the
  difference of paired proportions (Newcombe 1998, method 10; Fagerland, Lydersen and Laake,
  "Statistical Analysis of Contingency Tables", ch. 8), from Wilson intervals of the two
  marginals and their estimated correlation.
- `sign_flip_p(d)`: the paired permutation test of per-item differences d_i: exactly
  McNemar's when every d_i is -1, 0 or 1, else exact over all sign flips of the nonzero d_i
  (up to `EXACT_FLIPS`) or Monte Carlo with a fixed seed.
- `bootstrap_ci(values, statistic)`: percentile bootstrap over items, fixed seed.
- `wilson(successes, n)`: Wilson score interval of one proportion.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

Z95 = 1.959963984540054  # the 97.5% normal quantile
EXACT_FLIPS = 16  # nonzero differences up to which the sign-flip test enumerates 2^m flips
MONTE_CARLO_FLIPS = 200_000
SEED = 20240613  # every resampling here starts from this seed


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (n = 0: (0, 1))."""
    if n == 0:
        return 0.0, 1.0
    phat = successes / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs: with m = b + c and
    X ~ Binomial(m, 1/2), min(1, 2 P(X <= min(b, c))); 1 when m = 0."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b}, {c}")
    m = b + c
    if m == 0:
        return 1.0
    tail = Fraction(sum(math.comb(m, i) for i in range(min(b, c) + 1)), 2 ** m)
    return float(min(Fraction(1), 2 * tail))


def newcombe_paired(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple[float, float]:
    """Interval for p1 - p2 = (b - c) / n from a paired 2x2 table: a both succeed, b only the
    first, c only the second, d neither."""
    n = a + b + c + d
    if n == 0:
        return -1.0, 1.0
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if margins > 0:
        cross = a * d - b * c
        if cross > n / 2:
            phi = (cross - n / 2) / math.sqrt(margins)
        elif cross < 0:
            phi = cross / math.sqrt(margins)
    delta = p1 - p2
    lower = delta - math.sqrt(max(0.0, (p1 - l1) ** 2 + (u2 - p2) ** 2
                                  - 2 * phi * (p1 - l1) * (u2 - p2)))
    upper = delta + math.sqrt(max(0.0, (p2 - l2) ** 2 + (u1 - p1) ** 2
                                  - 2 * phi * (p2 - l2) * (u1 - p1)))
    return max(-1.0, lower), min(1.0, upper)


def sign_flip_p(differences: Sequence[float], seed: int = SEED) -> float:
    """Two-sided p-value of the paired sign-flip test of mean(d) = 0 (see the module
    docstring); statistic |sum d|, ties counted as extreme."""
    d = np.asarray([x for x in differences if x != 0], dtype=np.float64)  # [m]
    if d.size == 0:
        return 1.0
    if np.all(np.isin(d, (-1.0, 1.0))):
        return mcnemar_exact(int((d > 0).sum()), int((d < 0).sum()))
    observed = abs(d.sum()) - 1e-12 * d.size  # ties with the observed sum count as extreme
    if d.size <= EXACT_FLIPS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))  # [2^m, m]
        return float(np.mean(np.abs(signs @ d) >= observed))
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(MONTE_CARLO_FLIPS, d.size))  # [B, m]
    return float((1 + np.sum(np.abs(signs @ d) >= observed)) / (1 + MONTE_CARLO_FLIPS))


def bootstrap_ci(values: Sequence[float] | np.ndarray,
                 statistic: Callable[[np.ndarray], np.ndarray] | None = None,
                 resamples: int = 10_000, level: float = 0.95, seed: int = SEED
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic` over items. `values` is [n] or [n, j]
    (j values per item, resampled together); `statistic` maps [B, n(, j)] resamples to [B]
    (default: the mean over items)."""
    x = np.asarray(values, dtype=np.float64)  # [n] or [n, j]
    if x.shape[0] == 0:
        raise ValueError("bootstrap needs at least one item")
    statistic = statistic or (lambda s: s.mean(axis=1))
    rng = np.random.default_rng(seed)
    index = rng.integers(0, x.shape[0], size=(resamples, x.shape[0]))  # [B, n]
    stats = statistic(x[index])  # [B]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return float(lo), float(hi)


def geometric_mean(ratios: Sequence[float] | np.ndarray) -> float:
    """exp(mean(log r)) of positive ratios."""
    r = np.asarray(ratios, dtype=np.float64)
    if r.size == 0 or np.any(r <= 0):
        raise ValueError("geometric_mean needs positive ratios")
    return float(np.exp(np.log(r).mean()))


def geometric_mean_ci(ratios: Sequence[float] | np.ndarray, resamples: int = 10_000,
                      level: float = 0.95, seed: int = SEED) -> tuple[float, float]:
    """Bootstrap interval of the geometric mean of per-item ratios (percentile on the log
    scale, so it is the same interval for r and 1 / r, inverted)."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))  # [n]
    lo, hi = bootstrap_ci(logs, None, resamples, level, seed)
    return math.exp(lo), math.exp(hi)
