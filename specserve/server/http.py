"""The HTTP server around the app: uvicorn, bounded for slow and many clients.

- `max_connections` open connections at most (uvicorn answers 503 beyond them);
- an idle kept-alive connection closes after `keep_alive_s`;
- a connection that has not sent a complete request head within `header_timeout_s` of
  opening (or of its last response) is closed (`HeaderTimeoutH11`), so a client that
  trickles its headers cannot hold a connection forever;
- the first SIGTERM or SIGINT starts the graceful drain; a second one forces the exit
  (`DrainingServer`: uvicorn itself forces only on a second SIGINT).

`warn_if_exposed` logs a warning when the server binds beyond loopback without an API key (and
when only loopback Host names are allowed there).
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import weakref

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.limits import LOOPBACK_HOSTS, ServerLimits

log = logging.getLogger("specserve.server")


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    header_timeout_s = ServerLimits().header_timeout_s  # set per server by `http_protocol`

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        """One timer per connection, holding no request: the cycle served so far, weakly."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        served = weakref.ref(self.cycle) if self.cycle is not None else None
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._close_if_no_head,
                                                  served)

    def _close_if_no_head(self, served) -> None:
        """No request head arrived since the timer was armed (the cycle is the same)."""
        served = served() if served is not None else None
        if self.cycle is served and not self.transport.is_closing() and (
                served is None or served.response_complete):
            log.debug("closing a connection that sent no request head in %.0f s",
                      self.header_timeout_s)
            self.transport.close()


def http_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """A `HeaderTimeoutH11` class with this server's header timeout."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn's server; any second exit signal forces the exit at once."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            self.force_exit = True
        super().handle_exit(sig, frame)


def server(app, host: str, port: int, bounds: ServerLimits, log_level: str, access_log: bool,
           graceful_s: float) -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="off", timeout_graceful_shutdown=graceful_s,
                            limit_concurrency=bounds.max_connections,
                            timeout_keep_alive=bounds.keep_alive_s,
                            http=http_protocol(bounds.header_timeout_s))
    return DrainingServer(config)


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None, bounds: ServerLimits) -> None:
    """Warn about binding beyond loopback without a key, and say which Host names are served."""
    if is_loopback(host):
        return
    if api_key is None:
        log.warning("specserve: binding %s (beyond loopback) without --api-key: anyone who can "
                    "reach this address can use the server", host)
    if all(is_loopback(h) for h in bounds.allowed_hosts):
        log.warning("specserve: only requests naming %s in their Host header are served; add "
                    "this machine's names with --allowed-hosts", ", ".join(bounds.allowed_hosts))
