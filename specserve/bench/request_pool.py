"""Many distinct requests for measuring a busy engine or server: the answer-checked tasks
(code edits, arithmetic, extraction; `specserve.bench.tasks`) and open-text requests (short
stories, poems, diaries, dialogues, fables, ...). Every text differs, so no request's answer
repeats an earlier one's: a cache of earlier outputs (the suffix drafter's) drafts from what
a real server would have seen, not from the same answer served again.

Pools (`distinct_pool`): "mixed", one open-text request to three tasks while the tasks last,
then the other open-text requests; "mixed-even", the same texts with the tasks spread evenly
through the whole list (about one in five: any stretch of it holds about the same mix);
"stories", the open-text requests alone; "long", requests about ~900 tokens of code each (a
stretch of a Python standard-library module, every stretch a different one), four kinds in
turn: a code edit (add type hints, change nothing else), an explanation, a review and a
documentation page (`long_requests`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specserve.bench.tasks import load_tasks

POOLS = ("mixed", "mixed-even", "stories", "long")
TASK_KINDS = ("code_edit", "arithmetic", "extraction")

# the first 48 open-text requests (the earlier, shorter pool) come first, so an offset into
# "mixed" names the same prompts as it did before the pool grew
STORY_TOPICS = ("a lighthouse keeper who finds a message in a bottle", "a dragon afraid of heights",
                "the first snow in a mountain village", "a robot learning to paint",
                "two rival bakers in Paris", "a lost cat finding its way home",
                "an astronaut's letter to her daughter", "a pirate who hates water",
                "a library that opens only at midnight", "a violinist who loses her hearing",
                "the last tree in a desert town", "a detective who cannot remember faces")
STORY_FORMS = ("Write a short story about {}.", "Write a poem about {}.",
               "Write a diary entry by {}.", "Write a dialogue between two people about {}.")
MORE_TOPICS = ("a clockmaker who can stop time for one minute a day",
               "a city where it has not rained for ten years", "a chess player's last tournament",
               "a whale that follows a fishing boat", "a girl who collects forgotten words",
               "a night train crossing the border", "a gardener on a space station",
               "an old map found inside a piano")
MORE_FORMS = ("Write a fable about {}.", "Write a news report about {}.",
              "Write a letter of complaint about {}.", "Write the opening scene of a play about {}.")


def stories() -> list[tuple[str, str]]:
    """("story", text) for every open-text request, the first 48 first."""
    out = [("story", form.format(topic)) for form in STORY_FORMS for topic in STORY_TOPICS]
    out += [("story", form.format(topic)) for form in STORY_FORMS for topic in MORE_TOPICS]
    return out + [("story", form.format(topic)) for form in MORE_FORMS
                  for topic in STORY_TOPICS + MORE_TOPICS]


LONG_MODULES = ("argparse", "textwrap", "shlex", "fnmatch", "glob", "heapq", "bisect",
                "colorsys", "csv", "difflib", "dataclasses", "enum", "functools", "getopt",
                "gettext", "gzip", "hmac", "ipaddress", "json.decoder", "json.encoder",
                "mimetypes", "netrc", "numbers", "operator", "optparse", "pprint", "queue",
                "quopri", "random", "sched", "secrets", "selectors", "shutil", "statistics",
                "string", "tabnanny", "tempfile", "timeit", "tokenize", "traceback", "uuid",
                "zipapp", "calendar", "configparser", "contextlib", "copy", "fractions")
LONG_CHARS = 3000  # a stretch's characters (about 900 tokens of Python)
LONG_KINDS = {
    "code_edit": "Rewrite this code with type hints added to every function signature, "
                 "changing nothing else. Answer with the code only.",
    "explain": "Explain in plain English what this code does and why, for a new team member.",
    "review": "Review this code as a senior engineer would: list concrete problems and "
              "suggest improvements.",
    "docs": "Write a documentation page for the functions and classes in this code, with a "
            "short usage example for each.",
}


def long_requests() -> list[tuple[str, str]]:
    """(kind, text) requests over stretches of about `LONG_CHARS` characters (cut at line
    ends) of the `LONG_MODULES` sources of the running Python, the kinds in turn."""
    out, kinds = [], list(LONG_KINDS)
    for name in LONG_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        lines, chunk = Path(spec.origin).read_text(encoding="utf-8").splitlines(True), ""
        for line in lines:
            chunk += line
            if len(chunk) >= LONG_CHARS:
                kind = kinds[len(out) % len(kinds)]
                out.append((kind, f"Here is part of Python's `{name}` module:\n\n```python\n"
                                  f"{chunk}```\n\n{LONG_KINDS[kind]}"))
                chunk = ""
    return out


def distinct_pool(which: str) -> list[tuple[str, str]]:
    """(kind, text) for every request of pool `which` (one of `POOLS`), in order."""
    if which not in POOLS:
        raise ValueError(f"pool must be one of {list(POOLS)}, got {which!r}")
    if which == "long":
        return long_requests()
    open_text = stories()
    if which == "stories":
        return open_text
    by_kind = [[(t.kind, t.prompt) for t in load_tasks((kind,))] for kind in TASK_KINDS]
    tasks = [group[i] for i in range(max(map(len, by_kind))) for group in by_kind
             if i < len(group)]
    rest = iter(open_text)
    if which == "mixed-even":
        total = len(tasks) + len(open_text)
        at = {int(j * total / len(tasks)): task for j, task in enumerate(tasks)}
        return [at[i] if i in at else next(rest) for i in range(total)]
    pool = []
    for i in range(0, len(tasks), len(TASK_KINDS)):
        pool += tasks[i:i + len(TASK_KINDS)] + [next(rest)]
    return pool + list(rest)
