"""The configuration tree and the flags generated from it: every flag of `generate`, `serve`,
`bench` and `demo` gives the config the Python API gives for the same value, errors name the
flag, and the speculation flags compose as documented in `specserve.config`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from specserve.bench.runner import BenchOptions
from specserve.cli import GENERATE_SAMPLING, SAMPLING_EXCLUDED, build_parser, sampling_params
from specserve.config import PAIR_DEFAULT, LLMConfig
from specserve.llm import LLM
from specserve.engine.config import EngineConfig
from specserve.flags import build
from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.sampling.params import SamplingParams
from specserve import default_speculation
from specserve.server.config import ServerConfig
from specserve.speculative.config import SpeculativeConfig
from specserve.weights.config import LoadConfig

PARSED = {"kv_cache_memory": ("2KiB", 2048)}  # fields whose flag text is parsed: (text, value)
# serve's speculation for the default pair when no flag names one (`default_speculation.decide`)
SPECULATION, _ = default_speculation.decide(DEFAULT_TARGET)
NEEDS = {"ray_address": {"replicas": 2}}  # fields valid only with another one


def option_fields(cls, exclude=()) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls)
            if f.metadata["option"]["cli"] and f.name not in exclude]


def example(field: dataclasses.Field, default):
    """A valid value for `field` other than `default`, and the argv that gives it."""
    meta = field.metadata["option"]
    flag = meta["flag"] or "--" + field.name.replace("_", "-")
    if field.name in PARSED:
        text, value = PARSED[field.name]
        return value, [flag, text]
    if isinstance(default, bool):
        return (not default), ["--no-" + flag[2:] if default else flag]
    if meta["choices"]:
        value = next(c for c in meta["choices"] if c != default)
    elif isinstance(default, tuple) or field.type.startswith("tuple"):
        if "int" in field.type:
            return (1, 2), [flag, "1", "2"]
        return ("a", "b"), [flag, "a", flag, "b"]
    elif isinstance(default, float) or field.type.startswith("float"):
        value = default / 2 if default else 0.5
    elif isinstance(default, int) or field.type.startswith("int"):
        value = 2 if default is None else default + 2
    else:
        value = "x-value"
    return value, [flag, str(value)]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def field_default(field: dataclasses.Field, overrides: dict):
    return overrides.get(field.name, field.default)


def cases(cls, exclude=(), overrides=None):
    out = []
    for f in option_fields(cls, exclude):
        value, argv = example(f, field_default(f, overrides or {}))
        kwargs, extra = {f.name: value}, []
        for name, v in NEEDS.get(f.name, {}).items():
            other = next(g for g in dataclasses.fields(cls) if g.name == name)
            kwargs[name] = v
            extra += example(other, None)[1][:1] + [str(v)]
        out.append(pytest.param(argv + extra, kwargs, id=f.name))
    return out


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("argv,kwargs", cases(LoadConfig) + cases(EngineConfig))
def test_every_load_and_engine_flag_gives_the_config_of_the_python_api(command, argv, kwargs,
                                                                        monkeypatch):
    # serve and generate decide their speculation for the model given (here a stand-in for
    # the decision, which reads the model's tokenizer): it is asked once, for that model
    asked = []
    monkeypatch.setattr(default_speculation, "decide", lambda target, draft: (
        asked.append((str(target), draft)) or dict(SPECULATION), "reason"))
    expected = LLMConfig.from_kwargs(speculative_config=SPECULATION, **kwargs)
    assert LLMConfig.from_args(parse(command, *argv)) == expected
    model = str(kwargs.get("model", DEFAULT_TARGET))
    assert asked == [(model, DEFAULT_DRAFT)]


@pytest.mark.parametrize("argv,kwargs", cases(SpeculativeConfig))
def test_every_speculative_flag_gives_the_config_of_the_python_api(argv, kwargs):
    (name, value), = kwargs.items()
    # generate: no speculation by default, so every flag but the method's and the draft's
    # goes with --ngram; serve: laid over the default speculation (its draft, k = -1)
    on_generate = kwargs if name in ("method", "model") else {"method": "ngram", **kwargs}
    if name == "model":
        on_generate = {"method": "draft_model", **kwargs}
    extra = [] if name in ("method", "model") else ["--ngram"]
    got = LLMConfig.from_args(parse("generate", *argv, *extra)).speculative
    assert got == SpeculativeConfig.from_dict(on_generate)
    # serve: --draft-model alone is method draft_model (k -1), not the default's hybrid
    on_serve = kwargs if name == "method" else on_generate if name == "model" \
        else {**SPECULATION, **kwargs}
    got = LLMConfig.from_args(parse("serve", *argv)).speculative
    assert got == SpeculativeConfig.from_dict(on_serve)


@pytest.mark.parametrize("argv,kwargs", cases(SamplingParams, SAMPLING_EXCLUDED, GENERATE_SAMPLING))
def test_every_sampling_flag_gives_the_params_of_the_python_api(argv, kwargs):
    assert sampling_params(parse("generate", *argv)) == SamplingParams(**{**GENERATE_SAMPLING,
                                                                          **kwargs})


@pytest.mark.parametrize("argv,kwargs", cases(ServerConfig))
def test_every_server_flag_gives_the_server_config(argv, kwargs, monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert build(ServerConfig, parse("serve", *argv)) == ServerConfig(**kwargs)


@pytest.mark.parametrize("argv,kwargs", cases(BenchOptions))
def test_every_bench_flag_gives_the_bench_options(argv, kwargs):
    assert build(BenchOptions, parse("bench", *argv)) == BenchOptions(**kwargs)


@pytest.mark.parametrize("command", ["bench", "demo"])
@pytest.mark.parametrize("argv,kwargs", cases(LoadConfig))
def test_bench_and_demo_take_the_same_model_flags(command, argv, kwargs):
    assert build(LoadConfig, parse(command, *argv)) == LoadConfig(**kwargs)


def test_no_flags_give_the_python_api_defaults_and_the_command_defaults(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    default_pair = LLMConfig.from_kwargs(speculative_config={
        "method": "hybrid", "model": DEFAULT_DRAFT, "num_speculative_tokens": -1})
    assert LLMConfig.from_args(parse("generate")) == default_pair
    assert LLMConfig.from_args(parse("serve")) == default_pair
    assert sampling_params(parse("generate")) == SamplingParams(temperature=0.0, max_tokens=256)
    assert build(ServerConfig, parse("serve")) == ServerConfig()
    assert build(BenchOptions, parse("bench")) == BenchOptions()
    args = parse("demo")
    assert (args.draft_model, args.num_speculative_tokens, args.max_tokens) == (DEFAULT_DRAFT, -1, 160)


def test_the_python_api_speculates_by_default_only_for_the_default_pair():
    """`LLM()` is the default pair with serve's speculation; an explicit None is plain
    decoding, and another model speculates only when asked (as in vLLM)."""
    pair = SpeculativeConfig.from_dict({"method": "hybrid", "model": DEFAULT_DRAFT,
                                         "num_speculative_tokens": -1})
    assert LLMConfig.from_kwargs().speculative == pair
    assert LLMConfig.from_kwargs(DEFAULT_TARGET).speculative == pair
    assert LLMConfig.from_kwargs(DEFAULT_TARGET, speculative_config=None).speculative is None
    assert LLMConfig.from_kwargs("some/model.gguf").speculative is None
    assert inspect.signature(LLM).parameters["speculative_config"].default is PAIR_DEFAULT


def test_the_public_flag_names_stay():
    args = parse("generate", "-k", "3", "--draft-model", "d", "--no-bonus-token", "--max-model-len",
                 "64", "--stop", "x", "--stop", "y", "--stop-token-ids", "5", "6", "--ignore-eos")
    config = LLMConfig.from_args(args)
    assert config.speculative == SpeculativeConfig(method="draft_model", model="d",
                                                   num_speculative_tokens=3, bonus_token=False)
    assert config.engine.max_model_len == 64
    params = sampling_params(args)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (("x", "y"), (5, 6), True)
    server = build(ServerConfig, parse("serve", "--no-access-log", "--port", "9"))
    assert (server.access_log, server.port) == (False, 9)
    assert LLMConfig.from_args(parse("serve", "--kv-cache-memory", "2GiB")).engine.kv_cache_memory == 2 << 30


def test_the_api_key_flag_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", "secret")
    assert build(ServerConfig, parse("serve")).api_key == "secret"


@pytest.mark.parametrize("argv,message", [
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["serve", "--port", "70000"], "--port must be <= 65535, got 70000"),
    (["serve", "--ray-address", "auto"], "--ray-address needs --replicas"),
    (["serve", "--kv-cache-memory", "lots"], "--kv-cache-memory must be a size like 2GiB"),
    (["generate", "--ngram", "--prompt-lookup-min", "9"],
     "--prompt-lookup-min (9) must be <= prompt_lookup_max (4)"),
    (["generate", "--ngram", "-k", "99"], "--num-speculative-tokens must be -1 (adaptive) or 0..16"),
    (["generate", "--speculative-config", '{"method": "ngram", "max_k": 99}'], "max_k must be <= 16"),
])
def test_errors_name_the_flag_that_was_given(argv, message):
    args = parse(*argv)
    with pytest.raises(ValueError) as error:
        build(ServerConfig, args) if argv[0] == "serve" else None
        LLMConfig.from_args(args)
    assert str(error.value).startswith(message), str(error.value)


def test_speculation_flags_compose_and_contradictions_are_refused():
    spec = LLMConfig.from_args(parse("generate", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 2}', "-k", "5"))
    assert spec.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    serve = LLMConfig.from_args(parse("serve", "--draft-model", "d", "--tv-budget", "0.25"))
    assert serve.speculative == SpeculativeConfig(method="draft_model", model="d",
                                                  num_speculative_tokens=-1, tv_budget=0.25)
    assert LLMConfig.from_args(parse("serve", "--no-speculation")).speculative is None
    # a speculative flag without a method lays over the command's default speculation
    assert LLMConfig.from_args(parse("generate", "-k", "2")).speculative == SpeculativeConfig(
        method="hybrid", model=DEFAULT_DRAFT, num_speculative_tokens=2)
    for argv, needle in [(["generate", "--no-speculation", "-k", "2"], "--no-speculation"),
                         (["generate", "--ngram", "--speculative-method", "draft_model"], "--ngram"),
                         (["serve", "--no-speculation", "--tv-budget", "0.5"], "--no-speculation")]:
        with pytest.raises(ValueError, match=needle):
            LLMConfig.from_args(parse(*argv))


def test_llm_kwargs_round_trip_through_the_tree():
    config = LLMConfig.from_kwargs("m", "float32", {"method": "ngram"}, "int8", max_num_seqs=3,
                                   kv_cache_dtype="float16", enable_prefix_caching=False)
    assert LLMConfig.from_kwargs(**config.kwargs()) == config
    with pytest.raises(TypeError, match="max_num_seq"):
        LLMConfig.from_kwargs(max_num_seq=3)
