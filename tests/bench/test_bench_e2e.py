"""`specserve bench` end to end on tiny random models: suites run, files are written, and the
JSON holds what the report promises."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main
from tests import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path_factory.mktemp("t"))
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path_factory.mktemp("d"))
    work = tmp_path_factory.mktemp("w")
    for name in ("code_edit", "creative", "summarize", "chat_short"):
        (work / f"{name}.txt").write_text(f"Please write about {name} and the theory of the cat.")
    return t, d, work


@pytest.mark.parametrize("suite", ["seed-table", "policies", "ngram"])
def test_suite_runs_end_to_end_and_writes_reports(pair, tmp_path, suite):
    t, d, work = pair
    out = tmp_path / "out"
    rc = main(["bench", "--suite", suite, "--model", str(t), "--draft-model", str(d), "--dtype", "float32",
               "--max-tokens", "6", "--repeats", "1", "--seeds", "1", "--workload-dir", str(work),
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / f"{suite}.json").read_text())
    assert {"cpu", "cores", "torch", "threads", "dtype"} <= set(data["machine"])
    assert data["records"] and data["summary"]
    rec = next(r for r in data["records"] if r["speculative"])
    assert {"e2e_s", "ttft_s", "decode_tokens_per_s", "nll", "distinct_2", "distinct_3"} <= set(rec)
    assert {"acceptance_rate", "mean_acceptance_length", "rounds", "k_histogram", "mean_tv"} <= set(rec["speculative"])
    assert "0" in rec["cost_model"]["verify_s"]  # what the engine's cost model believed
    row = next(r for r in data["summary"] if r["config"] != "target only")
    assert row["speedup_decode"] is not None and row["acceptance"] is not None
    md = (out / f"{suite}.md").read_text()
    assert "| config |" in md and "target only" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 4
    lines = (out / f"{suite}.records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == data["records"]
    assert all((out / p).stat().st_size > 1000 for p in pngs)


def test_timed_calls_are_interleaved_round_robin(pair):
    """Call i of every configuration runs before call i + 1 of any, so drift of a shared
    machine hits every configuration alike; a greedy configuration makes one call per repeat,
    a sampled one one per seed and repeat."""
    from specserve.bench.runner import Bench, BenchOptions
    from specserve.bench.suites import BenchConfig
    from specserve.weights.loader import load_model

    t, d, _ = pair
    bench = Bench(load_model(t, "float32"), load_model(d, "float32"),
                  BenchOptions(max_tokens=4, repeats=1, seeds=3, quality=False))
    jobs = [(BenchConfig("target only", None, 0.0, ("a",)), "a", "hello cat"),
            (BenchConfig("fixed 2", {"method": "draft_model", "num_speculative_tokens": 2}, 0.7, ("a",)),
             "a", "hello cat")]
    order = [(j, rec["seed"]) for j, rec in bench.run_interleaved(jobs)]
    assert order == [(0, 0), (1, 0), (1, 1), (1, 2)]
