"""The task set and its checkers, against known right and wrong answers: every reference edit
passes exactly, unedited sources fail where the instruction changes behaviour, and the
numeric and JSON checkers accept the answers and reject near misses."""

from __future__ import annotations

import json

import pytest

from specserve.bench import checkers
from specserve.bench.checkers import check, check_code, check_json, check_number, final_number
from specserve.bench.tasks import KINDS, Task, load_tasks

TASKS = load_tasks()
CODE = [t for t in TASKS if t.kind == "code_edit"]
# edits that keep behaviour: the unedited source passes the calls but is not the reference
BEHAVIOUR_KEPT = {"code-comprehension", "code-iterative"}


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is the edited module:\n\n```{lang}\n{code}```\nDone."


def test_task_set_has_eight_to_twelve_unique_tasks_per_kind():
    assert [t.kind for t in TASKS] == sorted((t.kind for t in TASKS), key=KINDS.index)
    for kind in KINDS:
        assert 8 <= sum(t.kind == kind for t in TASKS) <= 12
    assert len({t.id for t in TASKS}) == len(TASKS)
    assert [t.id for t in load_tasks(per_kind=2)] == [t.id for k in KINDS
                                                    for t in [x for x in TASKS if x.kind == k][:2]]
    with pytest.raises(ValueError, match="kinds"):
        load_tasks(("poetry",))
    with pytest.raises(ValueError, match="per kind"):
        load_tasks(per_kind=0)


@pytest.mark.parametrize("task", CODE, ids=lambda t: t.id)
def test_reference_edit_passes_and_unedited_source_does_not_match(task):
    ref = check(task, fenced(task.data["reference"]))
    assert ref == checkers.Verdict(True, "ok", exact=True)
    src = check(task, fenced(task.data["source"]))
    assert src.exact is False
    assert src.correct == (task.id in BEHAVIOUR_KEPT), src.reason


def test_code_checker_behaviour_without_exact_match_and_failures():
    task = next(t for t in CODE if t.id == "code-empty-mean").data
    other = "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n"
    v = check_code(fenced(other), task)
    assert v.correct and v.exact is False
    assert check_code(task["reference"], task).correct  # no fence: the whole reply is the module
    assert "does not parse" in check_code(fenced("def mean(xs)\n    return 0\n"), task).reason
    assert check_code(fenced("raise RuntimeError('no')\n"), task).reason == "module raised RuntimeError"
    assert check_code(fenced("import sys\nsys.exit(3)\n"), task).reason == "module raised SystemExit"
    wrong = check_code(fenced("def mean(xs):\n    return 1.0\n"), task)
    assert not wrong.correct and "mean([]) -> 1.0 (expected 0.0)" in wrong.reason


def test_code_checker_stops_a_module_that_never_returns(monkeypatch):
    monkeypatch.setattr(checkers, "CALL_TIMEOUT_S", 1.0)
    task = next(t for t in CODE if t.id == "code-rename").data
    v = check_code(fenced("def average(xs):\n    while True:\n        pass\n"), task)
    assert not v.correct and v.reason.startswith("timed out")


@pytest.mark.parametrize("reply, answer, correct", [
    ("12 * 7 = 84, 84 - 23 = 61.\nAnswer: 61", 61, True),
    ("Answer: 62", 61, False),
    ("84 - 23 = 61 pencils are left.", 61, True),          # no Answer line: the last number
    ("Answer: 61\nActually 60.", 61, True),                # the Answer line wins
    ("**Answer:** **31**", 31, True),
    ("Answer: $31.", 31, True),
    ("Answer: 1,200", 1200, True),
    ("Answer: 72.0", 72, True),
    ("Answer: -3", 3, False),
    ("I cannot tell.", 61, False),
])
def test_number_checker(reply, answer, correct):
    assert check_number(reply, answer).correct is correct


def test_final_number_reads_decimals_and_signs():
    assert final_number("x = -0.5 and then Answer: 2.25") == 2.25
    assert final_number("no digits") is None


def test_every_arithmetic_answer_is_accepted_in_the_requested_form():
    for task in (t for t in TASKS if t.kind == "arithmetic"):
        assert check(task, f"Some working.\nAnswer: {task.data['answer']}").correct
        assert not check(task, f"Answer: {task.data['answer'] + 1}").correct


def test_every_extraction_answer_is_accepted_and_a_changed_value_is_not():
    for task in (t for t in TASKS if t.kind == "extraction"):
        answer = task.data["answer"]
        assert sorted(answer) == sorted(task.data["keys"])
        assert check(task, "```json\n" + json.dumps(answer, indent=2) + "\n```").correct
        key = task.data["keys"][0]
        value = answer[key]
        changed = dict(answer, **{key: value + 1 if isinstance(value, int) and not
                                  isinstance(value, bool) else "something else"})
        assert not check(task, json.dumps(changed)).correct


@pytest.mark.parametrize("reply, correct, reason", [
    ('{"name": "maria  lopez", "age": 34, "current_city": "PORTO"}', True, "ok"),
    ('Sure! {"name": "Maria Lopez", "age": 34.0, "current_city": "Porto"} Hope it helps', True, "ok"),
    ('{"name": "Maria Lopez", "age": "34", "current_city": "Porto"}', True, "ok"),
    ('{"name": "Maria Lopez", "age": "thirty-four", "current_city": "Porto"}', False,
     "wrong age='thirty-four'"),
    ('{"name": "Maria Lopez", "age": 34, "current_city": "Valencia"}', False,
     "wrong current_city='Valencia'"),
    ('{"name": "Maria Lopez", "age": 34}', False, None),
    ('{"name": "Maria Lopez", "age": 34, "current_city": "Porto", "from": "Valencia"}', False, None),
    ("{broken json} and nothing else", False, "no JSON object in the reply"),
])
def test_json_checker(reply, correct, reason):
    v = check_json(reply, {"name": "Maria Lopez", "age": 34, "current_city": "Porto"})
    assert v.correct is correct
    if reason is not None:
        assert v.reason == reason


def test_json_checker_keeps_bools_and_lists_strict():
    answer = {"parking": False, "people": ["Ken", "Sofia"]}
    assert check_json('{"parking": false, "people": ["ken", "Sofia"]}', answer).correct
    assert not check_json('{"parking": 0, "people": ["Ken", "Sofia"]}', answer).correct
    assert not check_json('{"parking": false, "people": ["Sofia", "Ken"]}', answer).correct


@pytest.mark.parametrize("value, correct", [
    ('"4471"', True), ("4471", True), ("4471.0", True), ('" 4471 "', True),
    ('"4472"', False), ('"#4471"', False), ('"4471a"', False), ("true", False)])
def test_an_id_written_as_a_json_string_is_the_number(value, correct):
    # the shipped run's target-only reply: "order_id": "4471" (a string), expected 4471
    reply = f'{{"order_id": {value}, "quantity": 3, "unit_price": 2.50, "destination": "Leeds"}}'
    answer = {"order_id": 4471, "quantity": 3, "unit_price": 2.5, "destination": "Leeds"}
    assert check_json(reply, answer).correct is correct


@pytest.mark.parametrize("value, correct", [
    ('"14:30"', True), ("14.30", True), ('"14.30"', True), ('" 14:30 "', True),
    ("14.3", False), ('"14:31"', False), ('"2:30"', False), ("1430", False), ('"14"', False)])
def test_a_clock_time_compares_as_hours_and_minutes(value, correct):
    # the shipped run's target-only reply: "time": 14.30 (a JSON number), expected "14:30"
    reply = f'{{"day": "Thursday", "time": {value}, "room": "B2"}}'
    verdict = check_json(reply, {"day": "Thursday", "time": "14:30", "room": "B2"})
    assert verdict.correct is correct, verdict.reason


def test_the_two_replies_the_review_found_are_now_right():
    tasks = {t.id: t for t in TASKS}
    order = '```json\n{\n  "order_id": "4471",\n  "quantity": 3,\n  "unit_price": 2.50,\n' \
            '  "destination": "Leeds"\n}\n```'
    meeting = '```json\n{\n  "day": "Thursday",\n  "time": 14.30,\n  "room": "B2"\n}\n```'
    assert check(tasks["json-order"], order).correct
    assert check(tasks["json-meeting"], meeting).correct
    assert check_json('{"time": 14.3}', {"time": "14:30"}).reason == "wrong time=14.3"


def test_prompts_carry_what_the_checkers_need():
    by_kind = {t.kind: t for t in TASKS}
    assert "```python" in by_kind["code_edit"].prompt
    assert by_kind["code_edit"].data["source"] in by_kind["code_edit"].prompt
    assert "Answer: <number>" in by_kind["arithmetic"].prompt
    assert all(f'"{k}"' in by_kind["extraction"].prompt for k in by_kind["extraction"].data["keys"])
    with pytest.raises(ValueError, match="kind"):
        check(Task("x", "poetry", {}), "a poem")
