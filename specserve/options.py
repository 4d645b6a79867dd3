"""A configuration option, declared once: a dataclass field that carries its help text.

Every configuration of the package is a frozen, slotted dataclass validated in its
`__post_init__` (`EngineConfig`, `SpeculativeConfig`, `SamplingParams`, `LoadConfig`,
`ServerConfig`, `BenchOptions`). Its fields are declared with `option(...)`:

    max_num_seqs: int = option(8, "requests decoded together")

and that one line is the whole declaration: the Python API takes the field by name, and
`specserve.flags` turns it into the command-line flag `--max-num-seqs` (type from the
annotation, choices, default and help from here) on every command that offers that config.
Adding an option is adding such a field (and its check in `__post_init__`); nothing else is
edited. `option`'s keywords cover what a flag needs beyond the field:

- `choices`: the allowed values (a tuple, or a dict whose keys are the values);
- `flag`: the flag's name when it is not `--field-name` (e.g. `--draft-model` for the draft
  model of `SpeculativeConfig.model`), `short`: a one-letter alias (`-k`);
- `parse`: a function from the flag's text to the field's value (e.g. `parse_size`);
- `nargs="*"` for a tuple field given as several values after one flag; otherwise a tuple
  field's flag is repeatable (`--stop a --stop b`);
- `env`: an environment variable whose value is the flag's default;
- `cli=False`: no flag (an internal knob of the Python API).

A bool field with default True becomes `--no-field-name`, one with default False
`--field-name`; its help is a verb phrase saying what True does ("reuse the KV blocks of ..."),
which the `--no-` flag's help turns into "do not reuse the KV blocks of ...".
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import MISSING
from typing import Any, Callable

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
              "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def option(default: Any = MISSING, help: str = "", *, choices: tuple | dict | None = None,
           flag: str | None = None, short: str | None = None,
           parse: Callable[[str], Any] | None = None, nargs: str | None = None,
           env: str | None = None, cli: bool = True) -> Any:
    """A dataclass field with its help text and what its command-line flag needs."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "flag": flag, "short": short, "parse": parse, "nargs": nargs, "env": env,
                "cli": cli}
    return dataclasses.field(default=default, metadata={"option": metadata})


def describe(field: dataclasses.Field) -> dict:
    """The option metadata of a field (a plain field: help text empty, a flag of its name)."""
    return field.metadata.get("option", {"help": "", "choices": None, "flag": None,
                                         "short": None, "parse": None, "nargs": None,
                                         "env": None, "cli": True})


def flag_name(field: dataclasses.Field) -> str:
    """`--field-name`, or the name the option declares."""
    return describe(field)["flag"] or "--" + field.name.replace("_", "-")


def parse_size(text: str) -> int:
    """A byte count: '2GiB' → 2147483648; '500MB' → 500000000; '1024' → 1024."""
    m = SIZE.match(text)
    if not m:
        raise ValueError(f"must be a size like 2GiB or 512MiB, got {text!r}")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * SIZE_UNITS[unit])
