"""`specserve bench --concurrency`: levels run end to end on tiny models, and the summary's
figures follow from the records."""

from __future__ import annotations

import json

import pytest

from specserve.bench.concurrency import quantile, run_level, run_sustained, summarize_levels
from specserve.cli import main
from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
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


def test_disable_by_batch_size_flag_is_the_declared_option_checked_before_loading(capsys):
    """The flag comes from `SpeculativeConfig.disable_by_batch_size` (its help and check);
    a bad value is refused naming the flag, before any model is looked up."""
    from specserve.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    action = sub._option_string_actions["--disable-by-batch-size"]
    assert action.default == 4 and action.help.startswith("draft nothing while")
    rc = main(["bench", "--concurrency", "1", "--model", "/nonexistent/model",
               "--disable-by-batch-size", "0"])
    assert rc == 2
    assert "--disable-by-batch-size must be >= 1" in capsys.readouterr().err


def test_sustained_levels_run_end_to_end(tmp_path):
    """2 s in flight with 100-token requests: some finish within the window on a loaded 2-core
    box too (0.3 s with 200 tokens failed there: "no request finished within 0.3 s"), and the
    pool of prompts outlasts it on a fast one."""
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "t")
    d = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=1), tmp_path / "d")
    out = tmp_path / "out"
    rc = main(["bench", "--concurrency", "2", "--sustained", "2", "--model", str(t),
               "--draft-model", str(d), "--dtype", "float32", "--weights", "bf16",
               "--max-tokens", "100", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "concurrency.json").read_text())
    assert data["sustained_s"] == 2 and data["workloads"] == ["request_pool:mixed-even"]
    for rec in data["records"]:  # tokens counted after the ramp, 2 / 6 s, up to 2 s or the
        assert 2 / 6 < rec["window_s"] <= 2  # moment a fast machine ran through the pool
        assert rec["tokens_per_s"] == pytest.approx(rec["output_tokens"] / (rec["window_s"] - 2 / 6))
        assert rec["output_tokens"] > 0 and rec["requests"] >= 1
    assert "kept in flight for 2 s" in (out / "concurrency.md").read_text()


def test_bad_concurrency_levels_name_the_flag(capsys):
    assert main(["bench", "--concurrency", "1,x"]) != 0
    assert "--concurrency must be" in capsys.readouterr().err


def counting_clock():
    """A clock that reads 0, 1, 2, ...: one second per call."""
    ticks = iter(range(10_000))
    return lambda: float(next(ticks))


def test_a_sustained_run_keeps_its_level_in_flight_and_counts_only_the_window(int8_pair):
    target, draft = int8_pair
    llm = LLM(target, max_num_seqs=4)
    engine = llm.engine
    prompts = [[(5 * i + j) % 90 + 3 for j in range(6 + i % 5)] for i in range(40)]
    in_flight, made, added = [], [], []
    schedule, step, add = engine._schedule, engine.step, engine.add_request

    def recording_schedule():
        in_flight.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return schedule()

    def recording_step():
        deltas = step()
        made.append(sum(len(c.token_ids) for d in deltas for c in d.completions))
        return deltas

    def recording_add(ids, params, **kw):
        added.append(list(ids))
        return add(ids, params, **kw)

    engine._schedule, engine.step, engine.add_request = recording_schedule, recording_step, \
        recording_add
    # the clock reads 0 at the start and i after step i: steps 4..11 end inside [4, 12)
    res = run_sustained(llm, prompts, 3, 3, 0.0, seconds=12, ramp=4, clock=counting_clock())
    assert in_flight[:12] == [3] * 12  # a finished request is replaced before the next step
    assert res["output_tokens"] == sum(made[3:11]) > 0
    assert res["tokens_per_s"] == res["output_tokens"] / 8
    assert 3 < len(added) < len(prompts) and added == prompts[:len(added)]  # in order, once
    assert res["requests"] >= 1 and not engine.has_unfinished()  # the rest aborted and drained


def test_a_sustained_run_that_runs_out_of_prompts_before_its_ramp_says_so(int8_pair):
    llm = LLM(int8_pair[0], max_num_seqs=2)
    with pytest.raises(ValueError, match="ran out after .* before the ramp"):
        run_sustained(llm, [[5, 6, 7]] * 3, 2, 2, 0.0, seconds=50, ramp=40,
                      clock=counting_clock())


def test_a_pool_spent_after_the_ramp_ends_the_window_there(int8_pair):
    """A fast machine runs through the pool: the figures cover the ramp up to that moment."""
    llm = LLM(int8_pair[0], max_num_seqs=2)
    res = run_sustained(llm, [[5, 6, 7 + i] for i in range(6)], 2, 2, 0.0, seconds=50, ramp=1,
                        clock=counting_clock())
    assert 1 < res["window_s"] < 50 and res["wall_s"] == res["window_s"]
    assert res["tokens_per_s"] == res["output_tokens"] / (res["window_s"] - 1)
    assert res["requests"] >= 5 and not llm.engine.has_unfinished()


def test_every_run_starts_without_earlier_answers_to_draft_from(int8_pair):
    llm = LLM(int8_pair[0], speculative_config={"method": "suffix"})
    cache = llm.engine.spec.lookup.cache
    llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    assert cache.num_tokens > 0
    seen = []
    generate = llm.generate

    def recording(prompts, params):
        seen.append(cache.num_tokens)
        return generate(prompts, params)

    llm.generate = recording
    run_level(llm, [[5, 6, 7, 8]], 4, 0.0)
    assert seen == [0]
    assert cache.num_tokens > 0
    add = llm.engine.add_request

    def recording_add(ids, params, **kw):
        seen.append(cache.num_tokens)
        return add(ids, params, **kw)

    llm.engine.add_request = recording_add
    run_sustained(llm, [[9, 10, 11]] * 40, 1, 2, 0.0, seconds=4, ramp=1, clock=counting_clock())
    assert seen[1] == 0 and len(seen) > 2
