"""docs/reference.md is generated from the declared options, flags and metrics
(`specserve.reference`): it equals them, and it leaves out no config class and no flag."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from specserve import reference

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"


def test_the_reference_page_equals_the_declarations():
    assert PAGE.read_text() == reference.render(), (
        "docs/reference.md is stale: run `python -m specserve.reference > docs/reference.md`")


def test_every_class_that_declares_options_has_a_table():
    """A new config class (a dataclass whose fields are `option(...)`) must be added to
    `reference.SECTIONS`, or its options would be missing from the page."""
    declaring = set()
    for path in (ROOT / "specserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(s, ast.AnnAssign) and isinstance(s.value, ast.Call)
                    and getattr(s.value.func, "id", None) == "option" for s in node.body):
                declaring.add(node.name)
    assert declaring == {cls.__name__ for cls, _, _ in reference.SECTIONS}


def test_every_flag_of_every_command_is_on_the_page():
    page = reference.render()
    missing = []
    for name, parser in reference._commands().items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or "--help" in action.option_strings:
                continue
            flags = action.option_strings or [action.dest]
            missing += [f"{name} {f}" for f in flags if f"`{f}`" not in page]
    assert not missing, missing


def test_a_command_default_that_differs_from_the_declaration_is_shown():
    page = reference.render()
    row = next(line for line in page.splitlines()
               if line.startswith("| `max_tokens` | `--max-tokens` | `int \\| None`"))
    assert "`generate` (`256`)" in row and "`demo` (`160`)" in row
