"""The frontier suite: its configuration sets (the lossless default as the reference, FLy as
published), the summary's paired statistics over items (deterministic configurations counted
once, McNemar and Newcombe on 0/1 cells, the sign-flip test on fractional ones, per-item
speed ratios), the report and its doc section, and `specserve bench --suite frontier` end to
end on tiny random models with HumanEval problems."""

from __future__ import annotations

import json

import pytest

from specserve.bench import frontier_report
from specserve.bench.frontier import (CREATIVE, REFERENCE, TARGET_ONLY, FrontierOptions,
                                      fidelity_configs, frontier_configs, select_configs)
from specserve.bench.frontier_summary import pareto, summarize_frontier
from specserve.bench.stats import geometric_mean, mcnemar_exact, newcombe_paired
from specserve.cli import main
from tests import tiny
from tests.bench.test_humaneval import ADD, ROOT


def rec(config, method, item, seed, e2e, tokens, correct=None, t=0.0, out="a", kind=None):
    kind = kind or (CREATIVE if item == CREATIVE else "arithmetic")
    spec = None if method == TARGET_ONLY else {"drafted": 10, "accepted": 5, "mean_tv": 0.1}
    r = {"config": config, "method": method, "setting": "", "temperature": t,
         "workload": item, "kind": kind, "seed": seed, "e2e_s": e2e, "output_tokens": tokens,
         "output_hash": out, "speculative": spec, "distinct_2": 0.5, "nll": 1.0}
    if kind != CREATIVE:
        r.update(correct=correct, exact=None)
    return r


def deterministic_pair(outcomes_base, outcomes_x, seeds=3):
    """Target only and x, greedy, every item answered identically by each seed."""
    records = []
    for i, (yb, yx) in enumerate(zip(outcomes_base, outcomes_x)):
        for s in range(seeds):
            records.append(rec(TARGET_ONLY, TARGET_ONLY, f"m{i}", s, 10.0, 100, yb, out=f"b{i}"))
            records.append(rec("x", "FLy (published)", f"m{i}", s, 5.0, 100, yx, out=f"x{i}"))
    return records


def test_deterministic_configurations_are_counted_once_per_item():
    base = [True] * 14 + [False] * 6
    x = [True] * 10 + [False] * 4 + [True] * 2 + [False] * 4  # b = 2, c = 4 discordant
    rows = {r["config"]: r for r in summarize_frontier(deterministic_pair(base, x))}
    row = rows["x"]
    assert row["deterministic"] is True and row["items"] == 20 and row["calls"] == 60
    assert row["distinct_outputs"] == 20
    assert row["accuracy"] == pytest.approx(12 / 20)
    assert row["discordant"] == [2, 4] and row["test"] == "McNemar exact"
    assert row["p_value"] == mcnemar_exact(2, 4)
    assert (row["delta_lo"], row["delta_hi"]) == pytest.approx(newcombe_paired(10, 2, 4, 4))
    assert row["delta"] == pytest.approx(-2 / 20)
    # the interval is over 20 items, as wide as with one seed: seeds add no information
    one_seed = {r["config"]: r for r in summarize_frontier(deterministic_pair(base, x, 1))}["x"]
    assert (one_seed["accuracy_lo"], one_seed["accuracy_hi"]) == \
        (row["accuracy_lo"], row["accuracy_hi"])
    assert one_seed["deterministic"] is None  # one call per cell cannot tell
    assert rows[TARGET_ONLY]["delta"] == 0.0 and rows[TARGET_ONLY]["speedup"] == 1.0


def test_fractional_cells_use_item_means_the_sign_flip_test_and_a_bootstrap():
    records = []
    for i in range(12):
        for s in range(4):
            records.append(rec(TARGET_ONLY, TARGET_ONLY, f"m{i}", s, 10.0, 100, s < 2,
                               t=0.7, out=f"b{i}{s}"))
            records.append(rec("y", "mentored", f"m{i}", s, 5.0, 100, s < 3, t=0.7,
                               out=f"y{i}{s}"))
    row = {r["config"]: r for r in summarize_frontier(records)}["y"]
    assert row["deterministic"] is False and row["items"] == 12
    assert row["accuracy"] == pytest.approx(0.75) and row["delta"] == pytest.approx(0.25)
    assert row["test"] == "sign-flip" and row["p_value"] == pytest.approx(2 / 2**12)
    assert row["delta_lo"] == row["delta_hi"] == pytest.approx(0.25)  # every item moved alike


def test_speedup_is_the_geometric_mean_of_per_item_cell_medians():
    records = []
    for i, (b, x) in enumerate([(10.0, 5.0), (10.0, 10.0), (12.0, 3.0)]):
        for s, jitter in enumerate((1.0, 1.1, 50.0)):  # the outlier call is the median's to drop
            records.append(rec(TARGET_ONLY, TARGET_ONLY, f"m{i}", s, b * jitter, 100, True))
            records.append(rec("z", "mentored", f"m{i}", s, x * jitter, 100, True, out=f"{s}"))
    for r in records:  # decode rates: 100 tokens over the call's seconds
        r["decode_tokens_per_s"] = 100 / r["e2e_s"]
    row = {r["config"]: r for r in summarize_frontier(records)}["z"]
    assert row["speedup"] == pytest.approx(geometric_mean([2.0, 1.0, 4.0]))
    assert row["speedup_decode"] == pytest.approx(geometric_mean([2.0, 1.0, 4.0]))
    assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]
    assert row["min_calls_per_cell"] == 3 and row["acceptance"] == pytest.approx(0.5)


def test_pareto_keeps_only_undominated_rows():
    rows = [{"n": "a", "s": 1.0, "acc": 0.9}, {"n": "b", "s": 1.2, "acc": 0.8},
            {"n": "c", "s": 1.1, "acc": 0.7}, {"n": "d", "s": 1.2, "acc": 0.85},
            {"n": "e", "s": None, "acc": 1.0}]
    assert [r["n"] for r in pareto(rows, "s", "acc")] == ["a", "d"]
    assert [r["n"] for r in pareto(rows, "s", "acc", higher_y=False)] == ["c", "b"]


def test_configuration_sets_reference_and_published_fly():
    configs = fidelity_configs(6)
    by_name = {c.name: c for c in configs}
    assert [c.method for c in configs[:3]] == [TARGET_ONLY, REFERENCE, "lossless"]
    assert by_name[REFERENCE].spec == {"method": "hybrid", "num_speculative_tokens": -1}
    assert by_name["lossless k=6"].spec == {"method": "draft_model", "num_speculative_tokens": 6}
    published = by_name["FLy published k=15"]
    assert published.spec["num_speculative_tokens"] == 15
    assert published.sampling["fly_variant"] == "published"
    assert published.sampling["fly_window"] == 6
    assert {"mentored", "mentored (entropy)", "FLy (specserve)"} <= {c.method for c in configs}
    assert len({c.name for c in configs}) == len(configs)
    grid = frontier_configs(6)
    assert {c.name for c in configs} - {c.name for c in grid} == set()
    assert [c.sampling["fly_window"] for c in frontier_configs(2)
            if c.method == "FLy (specserve)"] == [1]
    picked = select_configs(configs, "lossless (default), FLy published k=15")
    assert [c.name for c in picked] == [TARGET_ONLY, REFERENCE, "FLy published k=15"]
    with pytest.raises(ValueError, match="frontier configs"):
        select_configs(configs, "TV=0.9 k=6")
    with pytest.raises(ValueError, match="k must be"):
        fidelity_configs(2)
    with pytest.raises(ValueError, match="seeds"):
        FrontierOptions(seeds=0)


def test_report_tables_flag_controls_and_fill_the_doc_section(tmp_path):
    records = deterministic_pair([True] * 8 + [False] * 2, [True] * 8 + [False] * 2)
    records += [dict(r, config=REFERENCE, method=REFERENCE) for r in records
                if r["config"] == "x"]
    rows = summarize_frontier(records)
    control = frontier_report.control_table(rows)
    assert REFERENCE in control and "| yes |" in control and "x †" not in control
    assert "x †" in frontier_report.table(rows)  # deterministic, counted once
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Doc\n\nbefore\n\n{frontier_report.BEGIN}\nSTALE TABLE\n"
                   f"{frontier_report.END}\nafter\n")
    frontier_report.write_docs(doc, rows, {"cpu": "cpu"}, {"seeds": 3}, tmp_path, None)
    text = doc.read_text()
    assert "STALE TABLE" not in text and "before" in text and "after" in text
    assert "### Lossless controls" in text and text.count(frontier_report.BEGIN) == 1
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("no markers")
    with pytest.raises(ValueError, match="section"):
        frontier_report.write_docs(unmarked, rows, {}, {}, tmp_path, None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path_factory.mktemp("t"))
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path_factory.mktemp("d"))
    return t, d


def test_frontier_suite_runs_humaneval_end_to_end_on_tiny_models(pair, tmp_path):
    t, d = pair
    creative = tmp_path / "creative.txt"
    creative.write_text("Write about the cat and the theory of the river.")
    problems = tmp_path / "problems.jsonl"  # two short problems: the tiny models' context
    problems.write_text("".join(json.dumps(p) + "\n" for p in (ADD, ROOT)))
    out = tmp_path / "out"
    names = "lossless (default),lossless k=3,TV=0.5 k=3,FLy published k=15"
    rc = main(["bench", "--suite", "frontier", "--model", str(t), "--draft-model", str(d),
               "--dtype", "float32", "--max-tokens", "6", "--seeds", "2", "--task-kinds",
               "humaneval,extraction", "--humaneval-file", str(problems),
               "--tasks-per-kind", "1",
               "--frontier-k", "3", "--frontier-configs", names, "--temperatures", "0,0.7",
               "--prompt-file", f"creative={creative}", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "frontier.json").read_text())
    assert len(data["records"]) == 2 * 4 * 2 * 5  # temperatures, items, seeds, configurations
    judged = [r for r in data["records"] if r["kind"] != CREATIVE]
    assert {r["kind"] for r in judged} == {"humaneval", "extraction"}
    assert all(isinstance(r["correct"], bool) and r["reason"] for r in judged)
    rows = {(r["config"], r["temperature"]): r for r in data["summary"]}
    assert rows[(TARGET_ONLY, 0.0)]["deterministic"] is True  # greedy: counted once
    assert rows[("FLy published k=15", 0.0)]["deterministic"] is True
    assert rows[(REFERENCE, 0.7)]["control"] and rows[(REFERENCE, 0.7)]["speedup"] is not None
    assert rows[("TV=0.5 k=3", 0.7)]["items"] == 3
    assert (out / "frontier.png").stat().st_size > 10_000
    md = (out / "frontier.md").read_text()
    assert "Lossless controls" in md and "speed/accuracy frontier" in md
    lines = (out / "frontier.records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == data["records"]
    # the report rebuilds from the records alone, with the run's machine and options
    (out / "frontier.json").unlink()
    doc = tmp_path / "fidelity.md"
    doc.write_text(f"{frontier_report.BEGIN}\n{frontier_report.END}\n")
    assert frontier_report.main([str(out), "--docs", str(doc)]) == 0
    assert "HumanEval" in doc.read_text() and (tmp_path / "fidelity-frontier.png").exists()
    assert json.loads((out / "frontier.json").read_text())["machine"]["target"]


def test_report_pools_runs_of_different_temperatures(tmp_path):
    greedy = deterministic_pair([True, False, True], [True, True, True])
    sampled = [dict(r, temperature=0.7) for r in deterministic_pair([True] * 3, [False] * 3)]
    for name, records in (("t0", greedy), ("t07", sampled)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "frontier.records.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "pooled"
    assert frontier_report.main([str(tmp_path / "t0"), str(tmp_path / "t07"), "--out", str(out),
                                 "--no-plots"]) == 0
    rows = json.loads((out / "frontier.json").read_text())["summary"]
    assert {(r["config"], r["temperature"]) for r in rows} == \
        {(c, t) for c in (TARGET_ONLY, "x") for t in (0.0, 0.7)}
    x = {r["temperature"]: r for r in rows if r["config"] == "x"}
    assert x[0.0]["delta"] == pytest.approx(1 / 3) and x[0.7]["delta"] == pytest.approx(-1.0)
