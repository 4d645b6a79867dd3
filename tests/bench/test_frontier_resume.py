"""A frontier run that grows piece by piece: `--resume` makes only the cells not yet recorded
(a killed piece loses nothing it recorded), every piece appends, a torn last line is dropped,
a different protocol is refused; the calls alternate their order item by item and a piece
stops on whole items at its deadline; the report counts each configuration's items and
compares repeated calls; and the lossy configurations are deterministic at T = 0 for a given
seed (flat budgets are not across seeds)."""

from __future__ import annotations

import gzip
import json

import pytest

from specserve.bench import frontier, frontier_records, frontier_report
from specserve.bench.frontier import (REFERENCE, TARGET_ONLY, FrontierOptions, FrontierRun,
                                      lossy_configs)
from specserve.bench.frontier_summary import coverage, repeat_agreement, summarize_frontier
from specserve.cli import main
from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from tests import tiny
from tests.bench.test_frontier import rec
from tests.bench.test_humaneval import ADD, ROOT

CONFIGS = "lossless (default),TV=0.5 k=3,FLy published k=15"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path_factory.mktemp("t"))
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path_factory.mktemp("d"))
    return t, d


def bench(pair, tmp_path, out, *extra):
    t, d = pair
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in (ADD, ROOT, dict(ADD, task_id="Toy/2"))))
    return main(["bench", "--suite", "frontier", "--model", str(t), "--draft-model", str(d),
                 "--dtype", "float32", "--max-tokens", "4", "--seeds", "1", "--task-kinds",
                 "humaneval", "--humaneval-file", str(problems), "--no-creative",
                 "--no-quality", "--frontier-set", "lossy", "--frontier-k", "3",
                 "--frontier-configs", CONFIGS, "--temperatures", "0", "--out", str(out),
                 *extra])


def test_a_killed_run_resumes_without_redoing_cells_and_appends(pair, tmp_path, monkeypatch):
    out = tmp_path / "run"
    made = []
    real_call = FrontierRun._call

    def dies_after_five(self, cfg, *a):
        if len(made) == 5:
            raise KeyboardInterrupt  # the piece is killed mid-run
        made.append((cfg.name, a[1]))
        return real_call(self, cfg, *a)

    monkeypatch.setattr(FrontierRun, "_call", dies_after_five)
    assert bench(pair, tmp_path, out) == 130  # the command's exit status on an interrupt
    first = (out / frontier_records.RECORDS).read_text()
    assert len(first.splitlines()) == 5
    with (out / frontier_records.RECORDS).open("a") as f:
        f.write('{"config": "torn')  # killed while writing the sixth
    monkeypatch.setattr(FrontierRun, "_call", lambda self, cfg, *a: (
        made.append((cfg.name, a[1])), real_call(self, cfg, *a))[1])
    assert bench(pair, tmp_path, out, "--resume") == 0
    assert len(made) == 3 * 4 and len(set(made)) == 12  # 3 items x 4 configs, none twice
    text = (out / frontier_records.RECORDS).read_text()
    assert text.startswith(first) and "torn" not in text  # appended after the kept records
    records = frontier_records.read_records(out)
    assert len({frontier_records.cell(r) for r in records}) == len(records) == 12
    meta = json.loads((out / frontier_records.META).read_text())
    assert [p["cells_before"] for p in meta["pieces"]] == [0, 5]
    # a third piece has nothing left to do and changes nothing
    made.clear()
    assert bench(pair, tmp_path, out, "--resume") == 0
    assert made == [] and (out / frontier_records.RECORDS).read_text() == text
    rows = json.loads((out / "frontier.json").read_text())["summary"]
    assert {r["config"]: r["items"] for r in rows} == {
        TARGET_ONLY: 3, REFERENCE: 3, "TV=0.5 k=3": 3, "FLy published k=15": 3}
    assert "| 0 | TV=0.5 k=3 | 3 / 3 |" in (out / "frontier.md").read_text()
    # packed for keeping: the same records, read back from the gzip alone
    frontier_records.pack(out)
    assert not (out / frontier_records.RECORDS).exists()
    assert frontier_records.read_records(out) == records
    # without --resume the folder starts afresh
    made.clear()
    assert bench(pair, tmp_path, out) == 0
    assert len(made) == 12 and not (out / frontier_records.PACKED).exists()


def test_resume_refuses_another_protocol(pair, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / frontier_records.META).write_text(json.dumps(
        {"options": {"max_tokens": 384, "temperatures": [0.0]}, "pieces": []}))
    assert bench(pair, tmp_path, out, "--resume") == 2
    assert "--resume: max_tokens is 4 here but 384" in capsys.readouterr().err
    assert bench(pair, tmp_path, out, "--minutes", "0") == 2
    assert "--minutes must be > 0" in capsys.readouterr().err


def test_a_piece_whose_start_outlasts_its_minutes_records_nothing_and_succeeds(pair, tmp_path):
    out = tmp_path / "run"
    assert bench(pair, tmp_path, out, "--minutes", "1e-9") == 0
    assert frontier_records.read_records(out) == []
    assert len(json.loads((out / frontier_records.META).read_text())["pieces"]) == 1
    assert bench(pair, tmp_path, out, "--resume") == 0  # the next piece does the work
    assert len(frontier_records.read_records(out)) == 12


def test_the_records_reader_drops_only_a_torn_last_line(tmp_path):
    good = [rec(TARGET_ONLY, TARGET_ONLY, f"m{i}", 0, 1.0, 10, True) for i in range(3)]
    with gzip.open(tmp_path / frontier_records.PACKED, "wt") as f:
        f.write(json.dumps(good[0]) + "\n")
    (tmp_path / frontier_records.RECORDS).write_text(
        "".join(json.dumps(r) + "\n" for r in good[1:]) + '{"config": ')
    assert frontier_records.read_records(tmp_path) == good  # gz first, then the plain file
    (tmp_path / frontier_records.RECORDS).write_text('{"x": \n' + json.dumps(good[1]) + "\n")
    with pytest.raises(json.JSONDecodeError):  # a broken line inside is damage, not a kill
        frontier_records.read_records(tmp_path)


class FakeRun(FrontierRun):
    """The run's ordering and deadline logic, without models: a call is a record."""

    def __init__(self, configs, items, skip=frozenset(), deadline=None):
        self.configs, self.skip, self.deadline = configs, skip, deadline
        self.opt = FrontierOptions(temperatures=(0.0,), seeds=1, creative=False)
        self.prompts = [(item, "humaneval", [1, 2], None) for item in items]

    def warm_up(self):
        pass

    def _call(self, cfg, temperature, item, kind, ids, task, seed):
        return {"config": cfg.name, "workload": item}


def test_calls_alternate_order_by_item_and_skip_recorded_cells():
    configs = lossy_configs(6)
    run = FakeRun(configs, ["a", "b", "c"], skip={(REFERENCE, 0.0, "b", 0)})
    calls = [(r["workload"], r["config"]) for r in run.records()]
    names = [c.name for c in configs]
    assert names[:2] == [TARGET_ONLY, REFERENCE] and len(names) == 7
    assert [c for i, c in calls if i == "a"] == names
    assert [c for i, c in calls if i == "b"] == [n for n in names[::-1] if n != REFERENCE]
    assert [c for i, c in calls if i == "c"] == names
    assert run.count() == 20


def test_a_piece_stops_at_its_deadline_on_a_whole_item(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(frontier.time, "monotonic", lambda: next(clock))
    run = FakeRun(lossy_configs(6), ["a", "b", "c"], deadline=1.5)  # item a at 0, b at 1
    calls = [r["workload"] for r in run.records()]
    assert calls == ["a"] * 7 + ["b"] * 7  # b started before the deadline and finished


def design(base: list[bool], lossy: list[bool], base_s: list[float], lossy_s: list[float]):
    records = []
    for i, (yb, yx, tb, tx) in enumerate(zip(base, lossy, base_s, lossy_s)):
        records.append(rec(TARGET_ONLY, TARGET_ONLY, f"HumanEval/{i}", 0, tb, 100, yb,
                           kind="humaneval", out=f"b{i}"))
        records.append(rec("TV=0.5 k=6", "mentored", f"HumanEval/{i}", 0, tx, 100, yx,
                           kind="humaneval", out=f"b{i}" if yx == yb else f"x{i}"))
    return records


def test_report_detects_a_real_accuracy_loss_and_not_a_chance_one():
    """164 items, one call each: 15 answers lost and 2 gained is a loss McNemar sees
    (p < 0.01, interval below 0); 3 lost and 2 gained is not (p > 0.5, interval holds 0)."""
    n = 164
    base = [True] * 118 + [False] * 46
    lost = [False] * 15 + [True] * 103 + [True] * 2 + [False] * 44  # 15 lost, 2 gained
    even = [False] * 3 + [True] * 115 + [True] * 2 + [False] * 44  # 3 lost, 2 gained
    seconds = [1.0] * n
    row = {r["config"]: r for r in summarize_frontier(design(base, lost, seconds, seconds))}
    loss = row["TV=0.5 k=6"]
    assert loss["discordant"] == [2, 15] and loss["p_value"] < 0.01
    assert loss["delta"] == pytest.approx(-13 / n) and loss["delta_hi"] < 0
    assert loss["same_text"] == n - 17
    twin = {r["config"]: r for r in summarize_frontier(design(base, even, seconds, seconds))}
    chance = twin["TV=0.5 k=6"]
    assert chance["discordant"] == [2, 3] and chance["p_value"] > 0.5
    assert chance["delta_lo"] < 0 < chance["delta_hi"]


def test_report_speedup_interval_excludes_one_only_for_a_real_speedup():
    """Per-item seconds with seeded noise: a true 1.2x geometric mean gives an interval above
    1 that holds 1.2; a true 1.0x gives one that holds 1."""
    import numpy as np

    rng = np.random.default_rng(5)
    base_s = np.exp(rng.normal(0.0, 0.3, 164))
    noise = np.exp(rng.normal(0.0, 0.2, 164))
    ok = [True] * 164
    fast = summarize_frontier(design(ok, ok, list(base_s), list(base_s / 1.2 * noise)))[1]
    assert 1.0 < fast["speedup_lo"] <= 1.2 <= fast["speedup_hi"]
    same = summarize_frontier(design(ok, ok, list(base_s), list(base_s * noise)))[1]
    assert same["speedup_lo"] <= 1.0 <= same["speedup_hi"]
    # seeded: the same records give the same interval
    again = summarize_frontier(design(ok, ok, list(base_s), list(base_s / 1.2 * noise)))[1]
    assert (again["speedup_lo"], again["speedup_hi"]) == (fast["speedup_lo"], fast["speedup_hi"])


def test_coverage_and_repeat_agreement_tables():
    first = design([True] * 4, [True] * 4, [1.0] * 4, [1.0] * 4)
    second = [dict(r) for r in first if r["workload"] in ("HumanEval/0", "HumanEval/1")]
    assert coverage(first) == {(0.0, TARGET_ONLY): 4, (0.0, "TV=0.5 k=6"): 4}
    agree = {r["config"]: r for r in repeat_agreement(first, second)}
    assert agree["TV=0.5 k=6"]["cells"] == 2 and agree["TV=0.5 k=6"]["same"] == 2
    second[1]["output_hash"] = "changed"  # must-fail twin: one repeat differs
    agree = {r["config"]: r for r in repeat_agreement(first, second)}
    assert agree["TV=0.5 k=6"]["same"] == 1 and agree["TV=0.5 k=6"]["differ"] == ["HumanEval/0"]
    table = frontier_report.coverage_table(first, 164)
    assert "| 0 | TV=0.5 k=6 | 4 / 164 |" in table
    assert "HumanEval/0" in frontier_report.repeat_table(list(agree.values()))


def test_lossy_configurations_are_deterministic_at_t0_for_a_seed(int8_pair):
    """The frontier's lossy settings, greedy, twice on one LLM (caches emptied as the suite
    does): the same tokens. A flat budget 0 < D < 1 keeps a wrong greedy draft with
    probability D drawn from the seed, so other seeds give other text (the twin), while FLy
    at T = 0 does not depend on the seed."""
    target, draft = int8_pair
    prompt = [5, 17, 33, 8, 90, 41]
    lossy = [c for c in lossy_configs(3) if c.method not in (TARGET_ONLY, REFERENCE)]
    assert len(lossy) == 5
    by_seed = {}
    for cfg in lossy:
        llm = LLM(target, draft=draft, speculative_config=tiny.draft_spec(
            cfg.spec["num_speculative_tokens"]))
        for seed in (0, 0, 1, 2, 3):
            llm.engine.spec.clear_cache()
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, seed=seed,
                                    **cfg.sampling)
            by_seed.setdefault(cfg.name, []).append(llm.generate(prompt, params)[0].token_ids)
    for name, outs in by_seed.items():
        assert outs[0] == outs[1], name  # seed 0 twice
    assert len({tuple(o) for o in by_seed["TV=0.5 k=3"]}) > 1  # other seeds, other text
    assert len({tuple(o) for o in by_seed["FLy published k=15"]}) == 1
