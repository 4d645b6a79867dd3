"""T_verify(k) / T_decode: how much a (k + 1)-row pass against a cached prefix costs compared
with a one-row decode step, on this machine, for a loaded model."""

from __future__ import annotations

from specserve.speculative.calibration import time_passes
from specserve.engine.runner import ModelRunner


def verify_cost(runner: ModelRunner, ks: list[int], prefix_len: int = 256, repeats: int = 5
                ) -> dict[int, float]:
    """Median seconds of a pass over k + 1 rows at position `prefix_len`, for k = 0 (the
    decode step) and each k in `ks`."""
    return time_passes(runner, [0, *ks], prefix_len, repeats)


def format_verify_cost(times: dict[int, float]) -> str:
    base = times[0]
    lines = ["| k | rows | T_verify ms | T_verify(k) / T_decode |", "|---|---|---|---|"]
    lines += [f"| {k} | {k + 1} | {t * 1e3:.1f} | {t / base:.2f} |" for k, t in sorted(times.items())]
    return "\n".join(lines)
