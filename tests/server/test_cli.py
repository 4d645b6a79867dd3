"""`specserve serve` flags: the default pair and speculation, contradictions and bad values refused
(exit 2, one line) before any model loads."""

import argparse

import pytest

from specserve.cli import build_parser, main
from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.server.cli import parse_size, server_limits, speculative_config
from specserve.server.limits import ServerLimits


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
    (["--speculative-config", "[1]"], "JSON object"), (["--api-key", " "], "--api-key"),
    (["--max-waiting", "-1"], "--max-waiting"), (["--step-timeout", "0"], "--step-timeout"),
    (["--max-slot-share", "2"], "--max-slot-share"), (["--allowed-hosts", ","], "--allowed-hosts"),
    (["--request-timeout", "0"], "--request-timeout"), (["--header-timeout", "0"], "--header-timeout")])
def test_bad_flags_exit_2_with_one_line_before_loading(argv, needle, capsys):
    assert main(["serve", "--model", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_limit_flags_default_to_server_limits_and_set_each_field():
    assert server_limits(_args()) == ServerLimits()
    bounds = server_limits(_args("--max-waiting", "3", "--request-timeout", "9", "--max-slot-share",
                                 "0.25", "--max-choices", "4", "--max-prompt-chars", "100",
                                 "--allow-special-tokens", "--allowed-hosts", "a.example, localhost",
                                 "--max-connections", "5", "--keep-alive-timeout", "2",
                                 "--header-timeout", "3"))
    assert bounds == ServerLimits(max_choices=4, max_prompt_chars=100, max_slot_share=0.25,
                                  request_timeout=9.0, max_waiting=3, special_tokens_in_prompts=True,
                                  allowed_hosts=("a.example", "localhost", "127.0.0.1"), max_connections=5,
                                  keep_alive_s=2.0, header_timeout_s=3.0)


def test_the_bound_address_is_an_allowed_host_and_a_wildcard_adds_nothing():
    assert server_limits(_args("--host", "192.168.1.5")).allows_host("192.168.1.5:8000")
    assert server_limits(_args("--host", "0.0.0.0")).allowed_hosts == ServerLimits().allowed_hosts
