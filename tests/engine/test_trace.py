"""The step trace: one JSON line per step, whose gains add up to the tokens generated."""

from __future__ import annotations

import json

import pytest

from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from tests import tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from specserve.weights.loader import load_model

    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path_factory.mktemp("m"))
    return load_model(path, "float32", weights="int8")


def test_every_step_is_traced_and_the_gains_add_up_to_the_output(model, tmp_path):
    trace = tmp_path / "steps.jsonl"
    llm = LLM(model, speculative_config={"method": "suffix", "num_speculative_tokens": -1},
              trace_steps=str(trace))
    outs = llm.generate(["the cat the cat the cat", "x"],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    first_tokens = len(outs)  # each prompt's last prefill chunk samples its first token
    assert sum(sum(s["gained"]) for s in steps) + first_tokens == sum(
        o.outputs[0].num_output_tokens for o in outs)
    decoding = [s for s in steps if s["B"]]
    assert decoding and all(len(s["k"]) == len(s["source"]) == s["B"] for s in decoding)
    assert any(s["source"][i] == "suffix" for s in decoding for i in range(s["B"]))
    assert all(s["accepted"][i] <= s["k"][i] for s in decoding for i in range(s["B"]))


def test_a_trace_path_must_be_a_path():
    from specserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="trace_steps"):
        EngineConfig(trace_steps="")


def generate_traced(model, path, n: int = 2):
    llm = LLM(model, speculative_config={"method": "suffix", "num_speculative_tokens": -1},
              trace_steps=str(path))
    return llm.generate(["the cat the cat"] * n,
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))


def test_a_link_in_the_trace_files_place_is_refused_at_start_up(model, tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "steps.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match=r"^trace_steps: cannot open .*symbolic link"):
        generate_traced(model, tmp_path / "steps.jsonl")
    assert target.read_text() == "keep me\n"


def test_a_trace_that_cannot_be_written_is_logged_and_fails_no_request(model, caplog):
    outs = generate_traced(model, "/dev/full")  # every write: ENOSPC
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    lost = [r for r in caplog.records if "not written" in r.getMessage()]
    assert len(lost) == 1 and "No space left" in lost[0].getMessage()  # once a minute at most


def test_the_trace_rotates_past_its_bound(model, tmp_path, monkeypatch):
    from specserve.engine import trace

    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 3000)
    path = tmp_path / "steps.jsonl"
    generate_traced(model, path, n=4)
    old, new = path.with_name("steps.jsonl.1"), path
    lines = old.read_text().splitlines() + new.read_text().splitlines()
    assert old.stat().st_size > 3000 and new.stat().st_size <= 3000 + max(map(len, lines)) + 1
    assert all(json.loads(line)["step_s"] >= 0 for line in lines)
