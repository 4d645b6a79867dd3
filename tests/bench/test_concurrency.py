"""`specserve bench --concurrency`: levels run end to end on tiny models, and the summary's
figures follow from the records."""

from __future__ import annotations

import json

import pytest

from specserve.bench.concurrency import quantile, summarize_levels
from specserve.cli import main
from tests import tiny


def test_quantile_interpolates_between_order_statistics():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([0.0, 10.0], 0.95) == pytest.approx(9.5)


def test_summary_takes_medians_and_compares_with_target_only_at_each_level():
    recs = [{"config": c, "concurrency": n, "tokens_per_s": t, "p50_latency_s": 1.0,
             "p95_latency_s": 2.0, "p50_ttft_s": 0.1, "p95_ttft_s": 0.2}
            for c, n, t in [("target only", 1, 10.0), ("target only", 1, 12.0), ("spec", 1, 15.0),
                            ("target only", 4, 30.0), ("spec", 4, 24.0)]]
    rows = {(r["config"], r["concurrency"]): r for r in summarize_levels(recs)}
    assert rows[("target only", 1)]["tokens_per_s"] == 11.0
    assert rows[("spec", 1)]["vs_target_only"] == pytest.approx(15 / 11)
    assert rows[("spec", 4)]["vs_target_only"] == pytest.approx(0.8)
    assert rows[("target only", 4)]["vs_single_target_only"] == pytest.approx(30 / 11)


def test_concurrency_levels_run_end_to_end(tmp_path):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "t")
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path / "d")
    out = tmp_path / "out"
    rc = main(["bench", "--concurrency", "1,3", "--model", str(t), "--draft-model", str(d),
               "--dtype", "float32", "--weights", "bf16", "--max-tokens", "5", "--repeats", "1",
               "--workloads", "chat_short", "--disable-by-batch-size", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "concurrency.json").read_text())
    assert [(r["config"], r["concurrency"]) for r in data["summary"]] == [
        (c, n) for n in (1, 3) for c in ("target only", "hybrid (default)",
                                         "hybrid, off at 2")]
    for rec in data["records"]:
        assert rec["output_tokens"] == 5 * rec["concurrency"]
        assert rec["p50_latency_s"] <= rec["p95_latency_s"]
    assert "| config | concurrent |" in (out / "concurrency.md").read_text()


def test_bad_concurrency_levels_name_the_flag(capsys):
    assert main(["bench", "--concurrency", "1,x"]) != 0
    assert "--concurrency must be" in capsys.readouterr().err
