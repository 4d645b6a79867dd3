"""Checkers for the benchmark's tasks (`specserve/bench/tasks/`): is a model's reply right?

- arithmetic: the number on the last `Answer:` line (else the last number in the reply)
  equals the answer within 1e-6 (thousands separators allowed: "1,200");
- extraction: the first JSON object in the reply (a ```json fence allowed) has exactly the
  expected keys, and each value equals the answer's once both are normalised (`same_value`):
  strings after trimming, collapsing spaces and case-folding; numbers within 1e-6, a number
  written as a JSON string ("4471") counting as that number; clock times as (hours,
  minutes), whether written "14:30", "14.30" or as the JSON number 14.30 (read as its
  literal, so 14.3 is not a time); bools only as bools; lists element by element;
- humaneval: the reply's code, with the problem's prompt, tests and `check(entry_point)`
  (`bench/humaneval.py`), runs to its end in the sandbox (`bench/sandbox.py`);
- code_edit: the module in the reply's first ``` block (else the whole reply) parses, and
  each of the task's calls, run on it in the sandbox (`bench/sandbox.py`, with a time
  limit), gives the expected `repr`; `exact` also records whether the module equals the
  reference up to trailing spaces and blank lines at either end.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from specserve.bench import humaneval
from specserve.bench.sandbox import SandboxLimits, run_program
from specserve.bench.tasks import Task

CALL_TIMEOUT_S = 10.0
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
TIME = re.compile(r"([01]?\d|2[0-3])[:.]([0-5]\d)")
FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)
# runs in a fresh `python -I`: exec the module, evaluate each call, print the results' reprs
# runs in the sandbox after `SOURCE` and `CALLS` are set: the module, then each call
HARNESS = """
ns = {"__name__": "edited"}
try:
    exec(compile(SOURCE, "edited.py", "exec"), ns)
except BaseException as e:
    RESULT = {"error": "module raised " + type(e).__name__}
else:
    out = []
    for call in CALLS:
        try:
            out.append(repr(eval(call, ns)))
        except BaseException as e:
            out.append("raised " + type(e).__name__)
    RESULT = {"results": out}
"""


@dataclass(frozen=True)
class Verdict:
    correct: bool
    reason: str  # why not, or "ok"
    exact: bool | None = None  # code edits: the reply equals the reference module


def check(task: Task, reply: str) -> Verdict:
    """Judge one reply to one task."""
    if task.kind == "arithmetic":
        return check_number(reply, task.data["answer"])
    if task.kind == "extraction":
        return check_json(reply, task.data["answer"])
    if task.kind == "code_edit":
        return check_code(reply, task.data)
    if task.kind == humaneval.KIND:
        return check_humaneval(reply, task.data)
    raise ValueError(f"task kind must be one of code_edit, arithmetic, extraction, humaneval, "
                     f"got {task.kind!r}")


# ---------------------------------------------------------------- arithmetic

def final_number(reply: str) -> float | None:
    """The number on the last `Answer:` line, else the last number in the reply."""
    answers = re.findall(r"answer\s*[:=]\s*\**\s*\$?\s*(-?[\d.,]+)", reply, re.IGNORECASE)
    candidates = answers or NUMBER.findall(reply)
    for text in reversed(candidates):
        text = text.replace(",", "").rstrip(".")
        try:
            return float(text)
        except ValueError:
            continue
    return None


def check_number(reply: str, answer: float) -> Verdict:
    value = final_number(reply)
    if value is None:
        return Verdict(False, "no number in the reply")
    if math.isclose(value, float(answer), rel_tol=0.0, abs_tol=1e-6):
        return Verdict(True, "ok")
    return Verdict(False, f"answered {value:g}, expected {answer:g}")


# ---------------------------------------------------------------- extraction

def first_json_object(reply: str) -> object | None:
    """The first JSON object that decodes, scanning from each '{' of the reply; its
    non-integral numbers stay `Decimal`s, which keep their literal ("14.30")."""
    decoder = json.JSONDecoder(parse_float=Decimal)
    for match in re.finditer(r"\{", reply):
        try:
            value, _ = decoder.raw_decode(reply, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def same_value(got: object, want: object) -> bool:
    """Whether an extracted value equals the answer's, after normalising both (see the
    module docstring)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(want, list):
        return (isinstance(got, list) and len(got) == len(want)
                and all(same_value(g, w) for g, w in zip(got, want)))
    if isinstance(want, str) and clock_time(want) is not None:
        return clock_time(got) == clock_time(want)
    if isinstance(want, (int, float)):
        value = as_number(got)
        return value is not None and math.isclose(value, want, rel_tol=0, abs_tol=1e-6)
    if isinstance(want, str):
        return isinstance(got, str) and _norm(got) == _norm(want)
    return got == want


def as_number(value: object) -> float | None:
    """A JSON number, or a string that is one number and nothing else ("4471", " 2.50 ")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, Decimal)):
        return float(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", value):
        try:
            return float(Decimal(value.strip()))
        except InvalidOperation:
            return None
    return None


def clock_time(value: object) -> tuple[int, int] | None:
    """(hours, minutes) of "14:30", "14.30" or the JSON number literal 14.30, else None."""
    if isinstance(value, Decimal):
        value = str(value)
    if not isinstance(value, str):
        return None
    match = TIME.fullmatch(value.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def _shown(value: object) -> str:
    return str(value) if isinstance(value, Decimal) else repr(value)


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def check_json(reply: str, answer: dict) -> Verdict:
    got = first_json_object(reply)
    if got is None:
        return Verdict(False, "no JSON object in the reply")
    if set(got) != set(answer):
        return Verdict(False, f"keys {sorted(got)}, expected {sorted(answer)}")
    wrong = [k for k in answer if not same_value(got[k], answer[k])]
    if wrong:
        return Verdict(False, "wrong " + ", ".join(f"{k}={_shown(got[k])}" for k in wrong))
    return Verdict(True, "ok")


# ---------------------------------------------------------------- code edits

def extract_code(reply: str) -> str:
    match = FENCE.search(reply)
    return match.group(1) if match else reply


def normalize_code(code: str) -> str:
    return "\n".join(line.rstrip() for line in code.strip("\n").splitlines()).strip("\n")


def run_calls(source: str, calls: list[str]) -> dict:
    """{"results": [repr per call]} or {"error": why}, from the sandbox (`sandbox.py`)."""
    program = f"SOURCE = {source!r}\nCALLS = {list(calls)!r}\n" + HARNESS
    run = run_program(program, SandboxLimits(wall_s=CALL_TIMEOUT_S,
                                             cpu_s=max(1, math.ceil(CALL_TIMEOUT_S))))
    if run.passed and isinstance(run.value, dict):
        return run.value
    if run.reason.startswith("timed out"):
        return {"error": f"timed out after {CALL_TIMEOUT_S:g} s"}
    return {"error": f"the module crashed the interpreter ({run.reason})"}


def check_humaneval(reply: str, data: dict,
                    limits: SandboxLimits = SandboxLimits()) -> Verdict:
    """Run the reply's code with the problem's tests in the sandbox (`bench/humaneval.py`)."""
    program = humaneval.assemble(data, humaneval.extract_code(reply))
    result = run_program(program, limits)
    return Verdict(result.passed, result.reason)


def check_code(reply: str, task: dict) -> Verdict:
    code = extract_code(reply)
    exact = normalize_code(code) == normalize_code(task["reference"])
    try:
        ast.parse(code)
    except SyntaxError as e:
        return Verdict(False, f"does not parse: {e.msg} (line {e.lineno})", exact)
    run = run_calls(code, task["calls"])
    if "error" in run:
        return Verdict(False, run["error"], exact)
    wrong = [f"{c} -> {got} (expected {want})" for c, got, want
             in zip(task["calls"], run["results"], task["expected"]) if got != want]
    return Verdict(not wrong, "; ".join(wrong) or "ok", exact)
