"""The `specserve` command on tiny random models: generate (prompt, file, stdin), demo, errors."""

from __future__ import annotations

import io
import json

import pytest

from specserve.cli import main
from tests import tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path_factory.mktemp("m")))


def test_generate_prints_json_with_speculative_metrics(model_dir, capsys):
    rc = main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "the cat", "--max-tokens", "8",
               "--ignore-eos", "--json", "--speculative-config",
               json.dumps({"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_output_tokens"] == 8 and out["finish_reason"] == "length"
    assert out["speculative"]["accepted"] == out["speculative"]["drafted"] > 0


def test_generate_reads_prompt_from_file_and_stdin(model_dir, tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("the cat")
    assert main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt-file", str(f),
                 "--max-tokens", "4", "--chat"]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat"))
    assert main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "-", "--max-tokens", "4",
                 "--ngram", "-k", "2"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_demo_runs_target_only_and_speculative(model_dir, capsys):
    assert main(["demo", "--model", model_dir, "--draft-model", model_dir, "--dtype", "float32",
                 "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "target-only" in out and "speedup" in out and "identical" in out


def test_bad_value_is_reported_with_the_field(model_dir, capsys):
    rc = main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "x", "--top-p", "0"])
    assert rc == 2
    assert "top_p" in capsys.readouterr().err
