"""The benchmark's own prompts, shipped as package data.

Four kinds of request that stress speculation differently: `code_edit` (a refactor whose
answer copies most of its input: prompt lookup and draft models thrive), `creative` (a long
original scene: drafts are often rejected), `summarize` (a summary that reuses the text's own
phrases and figures) and `chat_short` (one short chat turn). Each is a UTF-8 `.txt` file
beside this module; `specserve bench --list-workloads` shows them and `--prompt-file
NAME=PATH` adds or replaces one.

Three *sessions* are series of requests (`.json`: a system prompt, the user turns, and whether
each request carries the conversation so far): `agent_session` (a coding agent: every turn a
new request with the same tool schema and file, answered by a JSON tool call),
`agent_session_ledger` (the same agent on another file: `specserve bench --prime-session`
serves it before a timed session, as a server that has served another session) and
`code_revision_chat` (a chat whose answers revise the code of an earlier turn). They show
what drafting from earlier requests' outputs is worth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SUFFIX = ".txt"
SESSION_SUFFIX = ".json"


@dataclass(frozen=True)
class Session:
    """A series of chat requests: `turns` are the user messages, one request each; with
    `history` a request carries the earlier turns and the model's own answers to them."""

    system: str
    turns: tuple[str, ...]
    history: bool

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The chat of request `turn` (with the earlier turns and `answers` to them when the
        session carries its history)."""
        messages = [{"role": "system", "content": self.system}]
        if self.history:
            for user, answer in zip(self.turns[:turn], answers):
                messages += [{"role": "user", "content": user},
                             {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": self.turns[turn]}]


def sessions() -> tuple[str, ...]:
    """The shipped sessions' names, sorted."""
    return tuple(sorted(entry.name[:-len(SESSION_SUFFIX)]
                        for entry in resources.files(__name__).iterdir()
                        if entry.name.endswith(SESSION_SUFFIX)))


def load_session(name: str) -> Session:
    if name not in sessions():
        raise ValueError(f"session must be one of {list(sessions())}, got {name!r}")
    raw = json.loads(resources.files(__name__).joinpath(name + SESSION_SUFFIX)
                     .read_text(encoding="utf-8"))
    return Session(raw["system"], tuple(raw["turns"]), bool(raw["history"]))


def names() -> tuple[str, ...]:
    """The shipped workloads' names, sorted."""
    return tuple(sorted(entry.name[:-len(SUFFIX)] for entry in resources.files(__name__).iterdir()
                        if entry.name.endswith(SUFFIX)))


def load(name: str) -> str:
    """The prompt text of shipped workload `name`."""
    if name not in names():
        raise ValueError(f"workload must be one of {list(names())} or given with --prompt-file "
                         f"{name}=PATH, got {name!r}")
    return resources.files(__name__).joinpath(name + SUFFIX).read_text(encoding="utf-8")


def resolve(wanted: tuple[str, ...], files: dict[str, Path],
            directory: Path | None = None) -> dict[str, "str | Session"]:
    """The prompt of every wanted workload: from `files` (name → path) first, then from
    `directory` when one is given, else the shipped set. Raises before any work when a name
    has no prompt or a file cannot be read."""
    prompts = {}
    for name in wanted:
        if name in sessions() and name not in files:
            prompts[name] = load_session(name)
            continue
        path = files.get(name) or (directory / f"{name}{SUFFIX}" if directory else None)
        if path is None:
            prompts[name] = load(name)
            continue
        try:
            prompts[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"workload {name!r}: cannot read prompt file {path}: "
                             f"{getattr(err, 'strerror', None) or err}") from None
    return prompts
