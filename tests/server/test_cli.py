"""`specserve serve` flags: the default pair and speculation, contradictions and bad values refused
(exit 2, one line) before any model loads."""

import argparse

import pytest

from specserve.cli import build_parser, main
from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.server.cli import parse_size, speculative_config


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_no_arguments_mean_the_default_pair_int4_hybrid_on_localhost_8000():
    args = _args()
    assert (args.model, args.host, args.port) == (DEFAULT_TARGET, "127.0.0.1", 8000)
    assert args.weights in ("int4", "auto")  # "auto" keeps a quantized GGUF (the default pair) int4
    assert speculative_config(args) == {"method": "hybrid", "model": DEFAULT_DRAFT,
                                        "num_speculative_tokens": -1}


def test_speculation_flags_draft_json_and_off():
    assert speculative_config(_args("--draft-model", "d"))["model"] == "d"
    config = speculative_config(_args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert config == {"method": "ngram", "num_speculative_tokens": 3}
    assert speculative_config(_args("--no-speculation")) is None
    with pytest.raises(ValueError, match="--no-speculation"):
        speculative_config(_args("--no-speculation", "--draft-model", "d"))
    with pytest.raises(ValueError, match="--speculative-config"):
        speculative_config(_args("--speculative-config", "{nope"))


def test_sizes_parse_with_binary_and_decimal_units():
    assert parse_size("2GiB") == 2 << 30 and parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_size("lots")


@pytest.mark.parametrize("argv,needle", [
    (["--port", "70000"], "--port"), (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"), (["--kv-cache-memory", "x"], "--kv-cache-memory"),
    (["--speculative-config", "[1]"], "JSON object"), (["--api-key", " "], "--api-key")])
def test_bad_flags_exit_2_with_one_line_before_loading(argv, needle, capsys):
    assert main(["serve", "--model", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
