"""The benchmark's workloads are the project's own: shipped as package data, listed by the
CLI, replaceable with `--prompt-file`; optional parts of the benchmark say what is missing
before any work starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.bench import cli as bench_cli
from specserve.bench import workloads
from specserve.cli import main
from tests import tiny

REPO = Path(__file__).resolve().parents[2]
KINDS = ("chat_short", "code_edit", "creative", "summarize")


def test_every_default_workload_loads_from_the_source_package():
    assert workloads.names() == KINDS
    for name in KINDS:
        text = workloads.load(name)
        assert len(text.strip()) > 50, name
    # the code edit copies much of its input: the answer is mostly the module it is given
    assert workloads.load("code_edit").count("RateLimiter") >= 10


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(ValueError, match="workload must be one of"):
        workloads.load("poetry")


def test_every_default_workload_loads_from_an_installed_wheel(tmp_path):
    """Build the wheel, install it into a bare folder and load each workload from a process
    whose working directory is elsewhere: what `pip install specserve` users get."""
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), str(REPO)], check=True, capture_output=True)
    wheel = next(wheel_dir.glob("specserve-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    code = ("import specserve.bench.workloads as w, json; "
            "print(json.dumps({'file': w.__file__, 'texts': {n: w.load(n) for n in w.names()}}))")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    got = json.loads(out.stdout)
    assert got["file"].startswith(str(site))  # the installed copy, not the checkout
    assert got["texts"] == {name: workloads.load(name) for name in KINDS}


def test_list_workloads_names_each_shipped_prompt(capsys):
    assert main(["bench", "--list-workloads"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(KINDS)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_prompt_file_respects_each_configs_own_workloads(tmp_path):
    configs = json.dumps([{"name": "a", "workloads": ["mine"]},
                          {"name": "b", "workloads": ["creative"]}])
    got = bench_cli.load_configs(_args("--configs", configs, "--prompt-file", f"mine={tmp_path}/x"))
    assert {c.name: c.workloads for c in got} == {"a": ("mine",), "b": ("creative",)}


def test_prompt_file_joins_every_config_of_a_suite_and_workloads_filters(tmp_path):
    got = bench_cli.load_configs(_args("--suite", "ngram", "--prompt-file", f"mine={tmp_path}/x"))
    assert all(c.workloads[-1] == "mine" and "code_edit" in c.workloads for c in got)
    got = bench_cli.load_configs(_args("--suite", "ngram", "--prompt-file", f"mine={tmp_path}/x",
                                       "--workloads", "mine"))
    assert all(c.workloads == ("mine",) for c in got)


def test_prompt_file_replaces_a_shipped_prompt_and_bad_flags_name_themselves(tmp_path):
    mine = tmp_path / "creative.txt"
    mine.write_text("Once upon a cat.")
    assert workloads.resolve(("creative", "summarize"), {"creative": mine}) == {
        "creative": "Once upon a cat.", "summarize": workloads.load("summarize")}
    with pytest.raises(ValueError, match="cannot read prompt file"):
        workloads.resolve(("x",), {"x": tmp_path / "missing.txt"})
    with pytest.raises(ValueError, match="--prompt-file must be NAME=PATH"):
        bench_cli.prompt_files(_args("--prompt-file", "nameonly"))


def test_missing_prompt_file_fails_before_any_model_loads(tmp_path, capsys):
    rc = main(["bench", "--model", str(tmp_path / "no-such-model"), "--prompt-file",
               f"mine={tmp_path / 'missing.txt'}", "--workloads", "mine"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "missing.txt" in err and "no-such-model" not in err and len(err.strip().splitlines()) == 1


def test_requested_peer_that_is_not_installed_fails_up_front(tmp_path, capsys, monkeypatch):
    real = _real_find_spec()
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    rc = main(["bench", "--model", str(tmp_path / "no-such-model"), "--compare", "llama.cpp"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "pip install llama-cpp-python" in err and "no-such-model" not in err


def _real_find_spec():
    import importlib.util

    return importlib.util.find_spec


def test_bench_without_matplotlib_skips_plots_and_keeps_reports(tmp_path, monkeypatch, capsys):
    t = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "t")
    real = _real_find_spec()
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "out"
    configs = json.dumps([{"name": "target only", "workloads": ["chat_short"]}])
    rc = main(["bench", "--configs", configs, "--model", str(t), "--dtype", "float32",
               "--weights", "bf16", "--max-tokens", "4", "--repeats", "1", "--seeds", "1",
               "--no-quality", "--out", str(out)])
    assert rc == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert (out / "custom.json").exists() and (out / "custom.md").exists()
    assert not list(out.glob("*.png"))


def test_the_sessions_load_and_repeat_what_drafting_from_earlier_outputs_needs():
    assert workloads.sessions() == ("agent_session", "agent_session_ledger", "code_revision_chat")
    agent = workloads.load_session("agent_session")
    assert not agent.history and len(agent.turns) >= 4
    # every agent turn is a new request carrying the same file and the same tool schema
    assert all("class Warehouse" in turn for turn in agent.turns)
    assert '"tool"' in agent.system
    # the same agent on another file: what `--prime-session` serves before agent_session
    ledger = workloads.load_session("agent_session_ledger")
    assert ledger.system == agent.system and not ledger.history
    assert all("class Ledger" in turn and "Warehouse" not in turn for turn in ledger.turns)
    chat = workloads.load_session("code_revision_chat")
    assert chat.history and len(chat.turns) >= 3 and "def parse_duration" in chat.turns[0]
    with pytest.raises(ValueError, match="session must be one of"):
        workloads.load_session("poetry")


def test_a_sessions_request_carries_the_earlier_turns_only_with_history():
    turns = ("first?", "second?", "third?")
    with_history = workloads.Session("sys", turns, True)
    assert with_history.messages(2, ["a1", "a2"]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first?"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "second?"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "third?"}]
    alone = workloads.Session("sys", turns, False)
    assert alone.messages(2, ["a1", "a2"]) == [{"role": "system", "content": "sys"},
                                               {"role": "user", "content": "third?"}]
