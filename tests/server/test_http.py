"""The HTTP server's settings: what counts as loopback, the warning when binding beyond it, and
the bounds handed to uvicorn."""

from __future__ import annotations

import logging
import signal

import pytest

from specserve.server import http
from specserve.server.limits import ServerLimits


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.com", False)])
def test_loopback_addresses_and_names(host, loopback):
    assert http.is_loopback(host) is loopback


def test_binding_beyond_loopback_without_a_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="specserve.server"):
        http.warn_if_exposed("127.0.0.1", None, ServerLimits())
        assert not caplog.records
        http.warn_if_exposed("0.0.0.0", "key", ServerLimits(allowed_hosts=("api.example",)))
        assert not caplog.records
        http.warn_if_exposed("0.0.0.0", None, ServerLimits())
    text = caplog.text
    assert "without --api-key" in text and "--allowed-hosts" in text


def test_uvicorn_gets_the_connection_cap_the_timeouts_and_our_protocol():
    bounds = ServerLimits(max_connections=7, keep_alive_s=3.0, header_timeout_s=4.0,
                          body_timeout_s=5.0, write_timeout_s=6.0)
    server = http.server(object(), "127.0.0.1", 0, bounds, "info", False, 10)
    config = server.config
    assert (config.limit_concurrency, config.timeout_keep_alive) == (7, 3.0)
    assert issubclass(config.http, http.BoundedH11)
    assert (config.http.header_timeout_s, config.http.body_timeout_s,
            config.http.write_timeout_s) == (4.0, 5.0, 6.0)
    defaults = ServerLimits()
    assert (http.BoundedH11.header_timeout_s, http.BoundedH11.write_timeout_s) == (
        defaults.header_timeout_s, defaults.write_timeout_s)  # untouched


def test_a_second_exit_signal_forces_the_exit():
    server = http.server(object(), "127.0.0.1", 0, ServerLimits(), "info", False, 10)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit
