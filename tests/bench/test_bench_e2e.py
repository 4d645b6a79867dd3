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


def test_a_primed_session_drafts_from_the_primers_answers(pair):
    """`prime_session`: before each timed call of a session, the primer runs untimed on the
    same engine after its caches are emptied. Primed with itself (the same requests, greedy:
    the same answers), a session's every request drafts its answer from the shared cache, so
    it accepts more than unprimed; every call starts from the same state, so the repeats read
    alike; a name that is not a shipped session is refused."""
    from specserve.bench.runner import Bench, BenchOptions
    from specserve.bench.suites import BenchConfig
    from specserve.bench.workloads import Session
    from specserve.weights.loader import load_model

    t, _, _ = pair
    session = Session("You are a cat.", ("Tell me about the cat and the hat.",
                                         "Tell me about the dog and the log."), False)
    cfg = BenchConfig("suffix 4", {"method": "suffix", "num_speculative_tokens": 4}, 0.0, ("s",))
    options = BenchOptions(max_tokens=12, repeats=2, seeds=1, quality=False)
    target = load_model(t, "float32")
    spec = {}
    for primer in (None, session):
        bench = Bench(target, None, options, primer=primer)
        recs = [rec["speculative"] for _, rec in bench.run_interleaved([(cfg, "s", session)])]
        assert len(recs) == 2
        assert recs[0]["accepted"] == recs[1]["accepted"] and recs[0]["drafted"] == recs[1]["drafted"]
        spec[primer is not None] = recs[0]
    # 11 tokens after each prefill: two rounds of 4 drafts and a bonus, then no room to draft
    assert spec[True]["accepted"] == spec[True]["drafted"] == 2 * 8, spec
    assert spec[False]["accepted"] < spec[True]["accepted"], spec
    with pytest.raises(ValueError, match="prime_session must be one of"):
        BenchOptions(prime_session="poetry")
    assert Bench(target, None, BenchOptions(prime_session="agent_session_ledger")).primer.turns
