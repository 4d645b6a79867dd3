"""Every results folder or file the pages cite (README.md, BENCHMARKS.md, docs/) exists in the
tree, or is cited by commit (`git show <commit>:benchmarks/results/...`): the evidence a page
points to is there to read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![0-9a-f]:)benchmarks/results/[A-Za-z0-9_./-]*[A-Za-z0-9_/-]")


def cited(text: str) -> set[str]:
    return set(CITED.findall(text))


def test_every_results_path_a_page_cites_is_in_the_tree_or_cited_by_commit():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = sorted(f"{page.name}: {path}" for page in pages
                     for path in cited(page.read_text()) if not (ROOT / path).exists())
    assert not missing, missing


def test_a_path_cited_by_commit_is_not_taken_for_one_in_the_tree():
    text = "see `git show 60fa5f3:benchmarks/results/gone/` and benchmarks/results/here/x.json."
    assert cited(text) == {"benchmarks/results/here/x.json"}
