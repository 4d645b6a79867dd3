"""The frontier suite: Wilson intervals, the Pareto frontier, the summary's pairing of calls
for the E2E speedup, its configurations, and `specserve bench --suite frontier` end to end
on tiny random models (files written, replies judged, every method present)."""

from __future__ import annotations

import json

import pytest

from specserve.bench.frontier import (CREATIVE, FrontierConfig, FrontierOptions, frontier_configs,
                                      pareto, seeds_for, summarize_frontier, wilson)
from specserve.cli import main
from tests import tiny


def test_wilson_interval_known_values():
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def test_pareto_keeps_only_undominated_rows():
    rows = [{"n": "a", "s": 1.0, "acc": 0.9}, {"n": "b", "s": 1.2, "acc": 0.8},
            {"n": "c", "s": 1.1, "acc": 0.7}, {"n": "d", "s": 1.2, "acc": 0.85},
            {"n": "e", "s": None, "acc": 1.0}]
    assert [r["n"] for r in pareto(rows, "s", "acc")] == ["a", "d"]
    assert [r["n"] for r in pareto(rows, "s", "acc", higher_y=False)] == ["c", "b"]


def rec(config, method, workload, seed, e2e, tokens, correct=None, t=0.7, drafted=0, accepted=0):
    kind = CREATIVE if workload == CREATIVE else "arithmetic"
    spec = None if method == "target only" else {"drafted": drafted, "accepted": accepted,
                                                 "mean_tv": 0.1}
    r = {"config": config, "method": method, "setting": "", "temperature": t,
         "workload": workload, "kind": kind, "seed": seed, "e2e_s": e2e, "output_tokens": tokens,
         "speculative": spec, "distinct_2": 0.5, "nll": 1.0}
    if kind != CREATIVE:
        r.update(correct=correct, exact=None)
    return r


def test_summary_pairs_calls_and_normalizes_the_speedup_per_token():
    records = [rec("target only", "target only", "m1", 0, 10.0, 100, True),
               rec("target only", "target only", "m1", 1, 10.0, 100, False),
               rec("target only", "target only", CREATIVE, 0, 20.0, 200),
               # 5 s per 100 tokens where target only took 10 s: 2x; the creative call 1x
               rec("x", "FLy", "m1", 0, 5.0, 100, True, drafted=10, accepted=6),
               rec("x", "FLy", "m1", 1, 2.5, 50, True, drafted=10, accepted=4),
               rec("x", "FLy", CREATIVE, 0, 20.0, 200, drafted=20, accepted=10)]
    rows = {r["config"]: r for r in summarize_frontier(records)}
    x = rows["x"]
    assert x["accuracy"] == 1.0 and x["task_calls"] == 2
    assert (x["accuracy_lo"], x["accuracy_hi"]) == wilson(2, 2)
    assert x["acceptance"] == pytest.approx(20 / 40)
    # target: 40 s / 400 tokens = 0.1 s/token; x: 27.5 s / 350 tokens
    assert x["speedup_e2e"] == pytest.approx(0.1 / (27.5 / 350))
    assert x["speedup_e2e_creative"] == pytest.approx(1.0)
    assert rows["target only"]["accuracy"] == 0.5 and rows["target only"]["speedup_e2e"] == 1.0


def test_greedy_target_only_call_stands_for_every_seed():
    records = [rec("target only", "target only", "m1", 0, 10.0, 100, True, t=0.0),
               rec("y", "mentored", "m1", 0, 5.0, 100, True, t=0.0),
               rec("y", "mentored", "m1", 1, 5.0, 100, True, t=0.0)]
    rows = {r["config"]: r for r in summarize_frontier(records)}
    assert rows["y"]["speedup_e2e"] == pytest.approx(2.0)


def test_configs_cover_every_method_and_greedy_deterministic_ones_run_once():
    configs = frontier_configs(6)
    methods = [c.method for c in configs]
    assert methods[:2] == ["target only", "lossless"]
    assert {"mentored", "mentored (entropy)", "FLy"} <= set(methods)
    assert all(c.spec["num_speculative_tokens"] == 6 for c in configs[1:])
    assert all(c.sampling["fly_window"] < 6 for c in configs if c.method == "FLy")
    assert len({c.name for c in configs}) == len(configs)
    assert seeds_for(configs[0], 0.0, 3) == [0] and seeds_for(configs[0], 0.7, 3) == [0, 1, 2]
    fly = next(c for c in configs if c.method == "FLy")
    assert seeds_for(fly, 0.0, 3) == [0, 1, 2]
    assert [c.sampling["fly_window"] for c in frontier_configs(2) if c.method == "FLy"] == [1]
    with pytest.raises(ValueError, match="k must be"):
        frontier_configs(1)
    with pytest.raises(ValueError, match="seeds"):
        FrontierOptions(seeds=0)
    assert isinstance(configs[0], FrontierConfig)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path_factory.mktemp("t"))
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path_factory.mktemp("d"))
    return t, d


def test_frontier_suite_runs_end_to_end_on_tiny_models(pair, tmp_path):
    t, d = pair
    creative = tmp_path / "creative.txt"
    creative.write_text("Write about the cat and the theory of the river.")
    out = tmp_path / "out"
    rc = main(["bench", "--suite", "frontier", "--model", str(t), "--draft-model", str(d),
               "--dtype", "float32", "--max-tokens", "6", "--seeds", "2", "--tasks-per-kind",
               "1", "--frontier-k", "3", "--temperatures", "0,0.7", "--prompt-file",
               f"creative={creative}", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "frontier.json").read_text())
    configs = frontier_configs(3)
    assert {r["config"] for r in data["summary"]} == {c.name for c in configs}
    # greedy target-only and lossless once per prompt, everything else once per seed
    per_t = {0.0: sum(len(seeds_for(c, 0.0, 2)) for c in configs),
             0.7: sum(len(seeds_for(c, 0.7, 2)) for c in configs)}
    assert len(data["records"]) == 4 * (per_t[0.0] + per_t[0.7])  # 3 tasks + creative
    judged = [r for r in data["records"] if r["kind"] != CREATIVE]
    assert judged and all(isinstance(r["correct"], bool) and r["reason"] for r in judged)
    assert all(r["nll"] is not None for r in data["records"])
    row = next(r for r in data["summary"] if r["method"] == "FLy" and r["temperature"] == 0.7)
    assert row["speedup_e2e"] is not None and row["acceptance"] is not None
    assert row["accuracy_lo"] <= row["accuracy"] <= row["accuracy_hi"]
    md = (out / "frontier.md").read_text()
    assert "speed/accuracy frontier" in md and "target only" in md
    assert (out / "frontier.png").stat().st_size > 10_000
    lines = (out / "frontier.records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == data["records"]
