"""Command-line flags generated from the configuration dataclasses (see `specserve.options`).

`add_flags(parser, Config)` adds one flag per option of `Config`: its name (`--field-name`, or
the option's `flag`), type (the field's annotation: int, float, str, bool or a tuple of them),
choices, default and help all come from the field, so `generate`, `serve` and `bench` offer
the same option under the same name with the same meaning. `build(Config, args)` makes the
config from the parsed flags; it is validated by the config's own `__post_init__`, and an
error about a field is reworded to name its flag (`--max-num-seqs must be >= 1, got 0`).

Two ways to add a config's flags:
- plain: the flag's default is the field's (or the command's, from `defaults`), and
  `build` passes every flagged field;
- `overlay=True`: the flag's default is None ("not given"), and `given` returns only the
  fields given on the command line, to lay over a base (a JSON config, a command default).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from contextlib import contextmanager
from typing import Any, Iterator

from specserve.options import describe, flag_name

SCALARS = (bool, int, float, str)


def add_flags(parser, cls, *, defaults: dict | None = None, exclude: tuple[str, ...] = (),
              overlay: bool = False) -> None:
    """One flag per option of `cls` (not those in `exclude` or declared `cli=False`)."""
    for field in flagged(cls, exclude):
        default = (defaults or {}).get(field.name, dataclasses.MISSING)
        add_flag(parser, cls, field.name, default=default, overlay=overlay)


def add_flag(parser, cls, name: str, *, default: Any = dataclasses.MISSING,
             overlay: bool = False) -> None:
    """The flag of one field of `cls`; `default` replaces the field's default for this command."""
    field = _field(cls, name)
    meta = describe(field)
    kind, is_tuple = _kind(cls, field)
    if default is dataclasses.MISSING:
        default = _field_default(field)
    if meta["env"] and os.environ.get(meta["env"]) is not None:
        default = os.environ[meta["env"]]
    help_text = meta["help"]
    names = [flag_name(field)] + ([meta["short"]] if meta["short"] else [])
    dest = dest_of(field)
    if kind is bool:
        if default:
            names[0], help_text = "--no-" + flag_name(field)[2:], "do not " + help_text
        parser.add_argument(*names, dest=dest, action="store_const", const=not default,
                            default=None if overlay else default, help=help_text)
        return
    if default is not None and help_text:
        help_text += f" (default: {default})"
    kwargs: dict[str, Any] = {"dest": dest, "default": None if overlay else default,
                              "help": help_text}
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    if meta["parse"] is None:
        kwargs["type"] = kind
    if is_tuple:
        if meta["nargs"]:
            kwargs["nargs"] = meta["nargs"]
        else:
            kwargs["action"] = "append"
        if not overlay:
            kwargs["default"] = list(default or ())
    parser.add_argument(*names, **kwargs)


def flagged(cls, exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """The fields of `cls` that have flags."""
    return [f for f in dataclasses.fields(cls)
            if describe(f)["cli"] and f.name not in exclude]


def dest_of(field: dataclasses.Field) -> str:
    """The attribute of the parsed namespace that holds the field's flag."""
    return flag_name(field)[2:].replace("-", "_")


def given(cls, args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """The fields of `cls` given on the command line (overlay flags: not None), as values."""
    values = {}
    for field in flagged(cls, exclude):
        raw = getattr(args, dest_of(field), None)
        if raw is not None:
            values[field.name] = _convert(cls, field, raw)
    return values


def values(cls, args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> dict:
    """Every flagged field of `cls` with its parsed value (plain flags)."""
    out = {}
    for field in flagged(cls, exclude):
        raw = getattr(args, dest_of(field))
        out[field.name] = raw if raw is None else _convert(cls, field, raw)
    return out


def build(cls, args: argparse.Namespace, exclude: tuple[str, ...] = (), rename: bool = True,
          **fixed: Any):
    """`cls` from its flags (plain), plus `fixed` fields; errors name the flags."""
    names = tuple(f.name for f in flagged(cls, exclude)) if rename else ()
    with flag_errors(cls, names):
        return cls(**values(cls, args, exclude), **fixed)


@contextmanager
def flag_errors(cls, names: tuple[str, ...]) -> Iterator[None]:
    """Reword a ValueError that starts with one of the fields `names` of `cls`: the fields it
    names become their flags (`max_num_seqs must be >= 1` → `--max-num-seqs must be >= 1`)."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        flags = {f.name: flag_name(f) for f in dataclasses.fields(cls) if f.name in names}
        lead = next((n for n in sorted(flags, key=len, reverse=True)
                     if re.match(rf"{n}\b", text)), None)
        if lead is None:
            raise
        text = flags[lead] + text[len(lead):]
        for name, flag in flags.items():
            if name != lead:
                text = re.sub(rf"(?<![-\w]){name}\b", flag, text)
        raise ValueError(text) from None


def convert(cls, name: str, raw: Any) -> Any:
    """The value of field `name` of `cls` for its flag's parsed text `raw`."""
    return _convert(cls, _field(cls, name), raw)


def _convert(cls, field: dataclasses.Field, raw: Any) -> Any:
    parse = describe(field)["parse"]
    if parse is not None:
        with flag_errors(cls, (field.name,)):
            try:
                return parse(raw)
            except ValueError as e:
                raise ValueError(f"{field.name} {e}") from None
    return tuple(raw) if isinstance(raw, list) else raw


def _field(cls, name: str) -> dataclasses.Field:
    for field in dataclasses.fields(cls):
        if field.name == name:
            return field
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _kind(cls, field: dataclasses.Field) -> tuple[type, bool]:
    """The flag's scalar type and whether the field is a tuple of them, from the annotation."""
    hint = typing.get_type_hints(cls)[field.name]
    for arg in _union_args(hint):
        if arg in SCALARS:
            return arg, False
        if typing.get_origin(arg) is tuple:
            inner = typing.get_args(arg)[0]
            return (inner if inner in SCALARS else str), True
    return str, False


def _union_args(hint: Any) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)
