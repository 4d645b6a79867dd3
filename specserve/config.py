"""The configuration tree of an `LLM`, and the flags the commands offer for it.

    LLMConfig
      load:        LoadConfig           which model, its dtype and weight format
      engine:      EngineConfig         batch size, context length, KV cache budget and dtype
      speculative: SpeculativeConfig    drafting method, draft model, k, policy ... (or None)

Each node is a frozen dataclass that validates itself in `__post_init__` (a `ValueError`
naming the field), and each of its fields is declared once with `specserve.options.option`.
Both interfaces end in this tree: the Python API through `LLMConfig.from_kwargs` (what
`LLM(...)` calls with its keyword arguments), the commands through `add_llm_flags` and
`LLMConfig.from_args` (`generate` and `serve`; `bench` and `demo` take `LoadConfig`'s flags).

To add an option, add a field to the node it belongs to, e.g. in `EngineConfig`:

    max_prefill_seqs: int | None = option(None, "sequences prefilled in one step at most")

and check it in that node's `__post_init__`. It is then a keyword of `LLM(...)` (an
`EngineConfig` field) or a key of `speculative_config` (a `SpeculativeConfig` field), and the
flag `--max-prefill-seqs` of every command that offers the node, with the same default and help.

Speculation on the command line: `--speculative-config JSON` (vLLM's shape) is the base;
`--speculative-method`, `--ngram` (method ngram) and `--draft-model` (method draft_model, k -1
unless given) choose the method, and every other `SpeculativeConfig` flag (`-k`, `--tv-budget`,
...) is laid over it. Without a JSON base or a method flag the command's default speculation
is the base (`generate`: none, so a flag like `-k` alone is an error; `serve`: decided for the
model given, `default_speculation.decide`: hybrid with the default draft for the default
pair or a target of its vocabulary, else suffix drafting, cost-aware k); a method flag starts
from that method's own defaults. `--no-speculation` turns speculation off and contradicts
every other speculation flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Callable

from specserve.engine.config import EngineConfig
from specserve.default_speculation import COST_AWARE, for_llm, hybrid_speculation  # noqa: F401
from specserve.hub.registry import DEFAULT_TARGET
from specserve.flags import add_flags, build, flag_errors, given
from specserve.options import flag_name
from specserve.speculative.config import SpeculativeConfig
from specserve.weights.config import LoadConfig


class _PairDefault:
    """`LLM(...)`'s `speculative_config` when none is given (`default_speculation.for_llm`)."""

    def __repr__(self) -> str:
        return "<the default pair's speculation>"


PAIR_DEFAULT = _PairDefault()


JSON_EXAMPLE = '\'{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}\''


@dataclass(frozen=True, slots=True)
class LLMConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, kind in (("load", LoadConfig), ("engine", EngineConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, "
                             f"got {self.speculative!r}")

    @classmethod
    def from_kwargs(cls, model=DEFAULT_TARGET, dtype="auto", speculative_config=PAIR_DEFAULT,
                    weights="auto", **engine: object) -> LLMConfig:
        """The tree for `LLM(...)`'s keyword arguments: `model`, `dtype`, `weights`, the
        `speculative_config` (a dict, a SpeculativeConfig, None for none, or not given: the
        default pair's for the default target, `default_speculation.for_llm`) and any `EngineConfig`
        field (`max_num_seqs`, `max_model_len`, ...)."""
        if speculative_config is PAIR_DEFAULT:
            speculative_config = for_llm(model)
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        for name in engine:
            if name not in known:
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        load = LoadConfig(model, dtype, weights)
        return cls(load, EngineConfig(**engine), SpeculativeConfig.from_dict(speculative_config))

    def kwargs(self) -> dict:
        """The keyword arguments of `LLM(...)` that make this tree (`from_kwargs`'s inverse)."""
        engine = {f.name: getattr(self.engine, f.name) for f in dataclasses.fields(EngineConfig)}
        return dict(model=self.load.model, dtype=self.load.dtype, weights=self.load.weights,
                    speculative_config=self.speculative, **engine)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LLMConfig:
        """The tree from the flags of `add_llm_flags`; an error about a flag names the flag."""
        load, engine = build(LoadConfig, args), build(EngineConfig, args)
        raw = speculative_config(args)
        with flag_errors(SpeculativeConfig, tuple(given(SpeculativeConfig, args))):
            return cls(load, engine, SpeculativeConfig.from_dict(raw))


def add_llm_flags(parser: argparse.ArgumentParser,
                  speculation: Callable[[argparse.Namespace], dict] | None = None,
                  title: str = "speculative decoding") -> None:
    """`LoadConfig`'s, `EngineConfig`'s and the speculation flags; `speculation`: a function
    of the parsed flags giving the command's default speculative config, called only when
    no flag names a method (None: off unless a flag asks for it)."""
    add_flags(parser, LoadConfig)
    add_flags(parser.add_argument_group("engine"), EngineConfig)
    g = parser.add_argument_group(title)
    g.add_argument("--speculative-config", default=None,
                   help=f"JSON in vLLM's shape, e.g. {JSON_EXAMPLE}")
    g.add_argument("--ngram", action="store_true",
                   help="shorthand for --speculative-method ngram (prompt lookup)")
    g.add_argument("--no-speculation", action="store_true", help="plain target decoding only")
    add_flags(g, SpeculativeConfig, overlay=True)
    parser.set_defaults(speculation_default=speculation)


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The speculative config (a dict for `SpeculativeConfig.from_dict`, or None) that the
    speculation flags ask for; ValueError on contradictory flags or bad JSON."""
    chosen = given(SpeculativeConfig, args)
    if args.ngram:
        if chosen.get("method", "ngram") != "ngram":
            raise ValueError(f"--ngram contradicts --speculative-method {chosen['method']}")
        chosen["method"] = "ngram"
    if args.no_speculation:
        if args.speculative_config or chosen:
            raise ValueError(f"--no-speculation contradicts {_flags(chosen, args)}")
        return None
    if "model" in chosen and "method" not in chosen:
        chosen["method"] = "draft_model"
    default = args.speculation_default
    if args.speculative_config:
        base = _json_object("--speculative-config", args.speculative_config)
    elif "method" in chosen:
        base = {}
    elif default is not None:
        base = dict(default(args))
    elif chosen:
        raise ValueError(f"{_flags(chosen, args)} need speculation: give --draft-model, --ngram, "
                         "--speculative-method or --speculative-config")
    else:
        return None
    return {**base, **chosen}


def _flags(chosen: dict, args: argparse.Namespace) -> str:
    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    names = [flag_name(fields[name]) for name in chosen]
    if args.speculative_config:
        names.insert(0, "--speculative-config")
    return " / ".join(names)


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value
