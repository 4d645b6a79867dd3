"""The frontier suite's summary: one row per (configuration, temperature), every figure
paired with target only on the same items (`bench/stats.py`).

A cell is one configuration's calls on one item at one temperature (`seeds` calls). Its
score is the mean of its calls' outcomes; its distinct outputs are counted by output hash, so
a deterministic configuration (one distinct output in every cell) is counted once per item
and flagged. Per row:
- accuracy: mean cell score over the task items; Wilson interval over items when every score
  is 0 or 1, else a bootstrap over items;
- delta: its accuracy minus target only's on the same items, with Newcombe's paired interval
  and McNemar's exact test when both sides score 0 or 1 per item, else a bootstrap interval
  and the sign-flip test of the per-item differences;
- speedup: the geometric mean over items (tasks and the creative prompt) of target only's
  seconds per generated token over this configuration's (each cell's median over its calls,
  prefill included), with a bootstrap interval over items; `speedup_decode` likewise from
  decode tokens/s after the first token (prefill excluded: a reply that stops sooner is not
  charged its prompt's prefill over fewer tokens);
- same_text: on how many of the items both have this configuration's outputs are target
  only's (by hash; a lossless row's should be all at T = 0, up to near ties);
- acceptance, mean realised TV, the target's NLL per token (tasks; creative) and distinct-2
  (creative).

`coverage` counts the items each configuration has; `repeat_agreement` compares two runs'
outputs cell by cell (a configuration is deterministic where repeated calls agree).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np

from specserve.bench.frontier import CREATIVE, REFERENCE, TARGET_ONLY
from specserve.bench.stats import (bootstrap_ci, geometric_mean, geometric_mean_ci,
                                   mcnemar_exact, newcombe_paired, sign_flip_p, wilson)

CONTROLS = (REFERENCE, "lossless")  # lossless methods: their difference from target only is 0


def summarize_frontier(records: list[dict]) -> list[dict]:
    """Rows in the order the records first name (temperature, configuration)."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["temperature"], r["config"], r["workload"])].append(r)
    order = list(dict.fromkeys((r["temperature"], r["config"]) for r in records))
    base_name = next((r["config"] for r in records if r["method"] == TARGET_ONLY), None)
    rows = []
    for t, config in order:
        mine = {item: rs for (tt, c, item), rs in cells.items() if tt == t and c == config}
        base = {item: rs for (tt, c, item), rs in cells.items() if tt == t and c == base_name}
        rows.append(_row(t, mine, base, config == base_name))
    return rows


def _row(t: float, mine: dict[str, list[dict]], base: dict[str, list[dict]],
         is_base: bool) -> dict:
    first = next(iter(mine.values()))[0]
    calls = [r for rs in mine.values() for r in rs]
    tasks = {item: rs for item, rs in mine.items() if rs[0]["kind"] != CREATIVE}
    creative = mine.get(CREATIVE, [])
    distinct = [len({r["output_hash"] for r in rs}) for rs in mine.values()]
    row = {"config": first["config"], "method": first["method"], "setting": first["setting"],
           "temperature": t, "items": len(tasks), "calls": len(calls),
           "distinct_outputs": sum(distinct),
           "deterministic": (all(n == 1 for n in distinct)
                             if min(len(rs) for rs in mine.values()) > 1 else None),
           "min_calls_per_cell": min(len(rs) for rs in mine.values()),
           "control": first["method"] in CONTROLS}
    row.update(_accuracy(tasks))
    row.update(_paired(tasks, base, is_base))
    row["same_text"] = sum({r["output_hash"] for r in rs} == {r["output_hash"] for r in base[i]}
                           for i, rs in tasks.items() if i in base)
    row.update(_speed(mine, base, is_base))
    row.update(_quality(calls, tasks, creative))
    return row


def _score(rs: list[dict]) -> float:
    return sum(bool(r["correct"]) for r in rs) / len(rs)


def _binary(scores) -> bool:
    return all(s in (0.0, 1.0) for s in scores)


def _accuracy(tasks: dict[str, list[dict]]) -> dict:
    if not tasks:
        return {"accuracy": None, "accuracy_lo": None, "accuracy_hi": None,
                "accuracy_by_kind": {}, "code_exact": None}
    scores = {item: _score(rs) for item, rs in tasks.items()}
    values = list(scores.values())
    lo, hi = (wilson(int(sum(values)), len(values)) if _binary(values)
              else bootstrap_ci(values))
    kinds = sorted({rs[0]["kind"] for rs in tasks.values()})
    by_kind = {k: _mean([scores[i] for i, rs in tasks.items() if rs[0]["kind"] == k])
               for k in kinds}
    exact = [bool(r["exact"]) for rs in tasks.values() for r in rs if r["kind"] == "code_edit"]
    return {"accuracy": sum(values) / len(values), "accuracy_lo": lo, "accuracy_hi": hi,
            "accuracy_by_kind": by_kind, "code_exact": _mean(exact)}


def _paired(tasks: dict[str, list[dict]], base: dict[str, list[dict]], is_base: bool) -> dict:
    """This row's accuracy minus target only's on the items both have."""
    empty = {"delta": None, "delta_lo": None, "delta_hi": None, "p_value": None,
             "test": None, "discordant": None, "paired_items": 0}
    common = [i for i in tasks if i in base]
    if not common:
        return empty
    x = [_score(tasks[i]) for i in common]
    y = [_score(base[i]) for i in common]
    if is_base:
        return dict(empty, delta=0.0, paired_items=len(common))
    if _binary(x) and _binary(y):
        a = sum(xi == 1 and yi == 1 for xi, yi in zip(x, y))
        b = sum(xi == 1 and yi == 0 for xi, yi in zip(x, y))
        c = sum(xi == 0 and yi == 1 for xi, yi in zip(x, y))
        lo, hi = newcombe_paired(a, b, c, len(common) - a - b - c)
        return {"delta": (b - c) / len(common), "delta_lo": lo, "delta_hi": hi,
                "p_value": mcnemar_exact(b, c), "test": "McNemar exact", "discordant": [b, c],
                "paired_items": len(common)}
    d = [xi - yi for xi, yi in zip(x, y)]
    lo, hi = bootstrap_ci(d)
    return {"delta": sum(d) / len(d), "delta_lo": lo, "delta_hi": hi, "p_value": sign_flip_p(d),
            "test": "sign-flip", "discordant": None, "paired_items": len(common)}


def _seconds_per_token(rs: list[dict]) -> float | None:
    values = [r["e2e_s"] / r["output_tokens"] for r in rs
              if r.get("e2e_s") and r.get("output_tokens")]
    return statistics.median(values) if values else None


def _decode_rate(rs: list[dict]) -> float | None:
    values = [r["decode_tokens_per_s"] for r in rs if r.get("decode_tokens_per_s")]
    return statistics.median(values) if values else None


def _speed(mine: dict[str, list[dict]], base: dict[str, list[dict]], is_base: bool) -> dict:
    """E2E (seconds per token, prefill included) and decode (tokens/s after the first token)
    speedups over target only, per item, pooled as geometric means."""
    e2e, decode, creative = [], [], None
    for item, rs in mine.items():
        ours, theirs = _seconds_per_token(rs), _seconds_per_token(base.get(item, []))
        if ours and theirs:
            e2e.append(theirs / ours)
            if item == CREATIVE:
                creative = theirs / ours
        rate, base_rate = _decode_rate(rs), _decode_rate(base.get(item, []))
        if rate and base_rate:
            decode.append(rate / base_rate)
    out = {"speed_items": len(e2e), "speedup_creative": creative}
    for name, ratios in (("speedup", e2e), ("speedup_decode", decode)):
        if not ratios:
            out.update({name: None, f"{name}_lo": None, f"{name}_hi": None})
        elif is_base:
            out.update({name: 1.0, f"{name}_lo": None, f"{name}_hi": None})
        else:
            lo, hi = geometric_mean_ci(ratios) if len(ratios) > 1 else (None, None)
            out.update({name: geometric_mean(ratios), f"{name}_lo": lo, f"{name}_hi": hi})
    return out


def _quality(calls: list[dict], tasks: dict[str, list[dict]], creative: list[dict]) -> dict:
    specs = [r["speculative"] for r in calls if r.get("speculative")]
    drafted = sum(s["drafted"] for s in specs)
    tvs = [s["mean_tv"] for s in specs if s.get("mean_tv") is not None]
    return {"acceptance": sum(s["accepted"] for s in specs) / drafted if drafted else None,
            "mean_tv": _mean(tvs) if tvs else (0.0 if specs else None),
            "nll_tasks": _mean([r.get("nll") for rs in tasks.values() for r in rs]),
            "nll": _mean([r.get("nll") for r in creative]),
            "distinct_2": _mean([r["distinct_2"] for r in creative])}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else None


def pareto(rows: list[dict], x: str, y: str, higher_y: bool = True) -> list[dict]:
    """Rows no other row beats on both x (higher is better) and y; sorted by x."""
    pts = [r for r in rows if r.get(x) is not None and r.get(y) is not None]

    def better(a: dict, b: dict) -> bool:  # a dominates b
        ya, yb = (a[y], b[y]) if higher_y else (-a[y], -b[y])
        return a[x] >= b[x] and ya >= yb and (a[x] > b[x] or ya > yb)

    return sorted((r for r in pts if not any(better(o, r) for o in pts)), key=lambda r: r[x])


def coverage(records: list[dict]) -> dict[tuple[float, str], int]:
    """(temperature, configuration) -> how many task items it has recorded."""
    items: dict[tuple[float, str], set] = defaultdict(set)
    for r in records:
        if r["kind"] != CREATIVE:
            items[(r["temperature"], r["config"])].add(r["workload"])
    return {key: len(v) for key, v in items.items()}


def repeat_agreement(first: list[dict], second: list[dict]) -> list[dict]:
    """Per (temperature, configuration): the cells (item, seed) both runs recorded, and on how
    many every call's output is the same (by hash), in the first run's order."""
    def outputs(records):
        cells = defaultdict(set)
        for r in records:
            cells[(r["temperature"], r["config"], r["workload"], r["seed"])].add(r["output_hash"])
        return cells

    a, b = outputs(first), outputs(second)
    rows: dict[tuple, dict] = {}
    for key in a:
        if key in b:
            row = rows.setdefault(key[:2], {"temperature": key[0], "config": key[1],
                                            "cells": 0, "same": 0, "differ": []})
            row["cells"] += 1
            if len(a[key] | b[key]) == 1:
                row["same"] += 1
            else:
                row["differ"].append(key[2])
    return list(rows.values())
