"""The HTTP server around the app: uvicorn, bounded for slow and many clients.

Every stage of a connection is bounded in time (`BoundedH11`):
- `max_connections` open connections at most (uvicorn answers 503 beyond them);
- an idle kept-alive connection closes after `keep_alive_s`;
- a connection that has not sent a complete request head within `header_timeout_s` of
  opening (or of its last response) is closed, so a client that trickles its headers cannot
  hold a connection forever;
- a request whose body is not complete `body_timeout_s` after its head gets 408 and the
  connection is closed (a head with no body, a trickled body);
- a connection whose client leaves more than its send buffers unread (the kernel's, fixed at
  `send_buffer_bytes`, and the transport's) for `write_timeout_s` (writing stays paused that
  long) is dropped at once: the app sees the disconnect, so a stream it was sending is
  cancelled and its engine request aborted;
- each request's scope carries its connection's `Backlog` (the extension `BACKLOG`): what it
  was sent and its client has not taken yet (asyncio's buffer and the kernel's send queue),
  so that a stream can wait for its reader long before those buffers fill, and drop it once
  it has taken nothing for `write_timeout_s` (`Backlog.drained`, used by the guard);
- the first SIGTERM or SIGINT starts the graceful drain; a second one forces the exit
  (`DrainingServer`: uvicorn itself forces only on a second SIGINT).

`warn_if_exposed` logs a warning when the server binds beyond loopback without an API key (and
when only loopback Host names are allowed there).
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import logging
import signal
import socket
import struct
import sys
import termios
import time
import weakref

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.limits import LOOPBACK_HOSTS, ServerLimits

log = logging.getLogger("specserve.server")
DEFAULTS = ServerLimits()
BACKLOG = "specserve.backlog"  # the scope extension holding the connection's `Backlog`
# the kernel's count of bytes sent and not yet acknowledged by the peer (Linux: SIOCOUTQ)
_OUTQ = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
POLL_S = (0.005, 0.2)  # how often a waiting stream looks again: first, and at most (doubling)


class Backlog:
    """What one connection was sent that its client has not taken: asyncio's write buffer plus
    the kernel's send queue (bytes the client's side has not acknowledged; a client that stops
    reading stops acknowledging once its own receive buffer is full). Holds its connection
    weakly."""

    def __init__(self, protocol: BoundedH11) -> None:
        self._protocol = weakref.ref(protocol)

    def unsent(self) -> int:
        """Bytes sent or queued and not taken yet (0 once the connection is gone)."""
        protocol = self._protocol()
        transport = protocol.transport if protocol is not None else None
        if transport is None or transport.is_closing():
            return 0
        return transport.get_write_buffer_size() + _kernel_unsent(transport)

    async def drained(self, bound: int, timeout: float) -> None:
        """Return once at most `bound` bytes are unsent; a client that takes nothing for
        `timeout` seconds meanwhile is dropped (the connection aborted: the app sees it gone)."""
        unsent = self.unsent()
        if unsent <= bound:
            return
        delay, since = POLL_S[0], time.monotonic()
        while True:
            await asyncio.sleep(delay)
            now, before, unsent = time.monotonic(), unsent, self.unsent()
            if unsent <= bound:
                return
            if unsent < before:
                since = now  # it took something: the clock starts again
            elif now - since >= timeout:
                protocol = self._protocol()
                if protocol is not None and not protocol.transport.is_closing():
                    log.debug("dropping a connection whose client took nothing of its last "
                              "%d bytes in %.0f s", unsent, timeout)
                    protocol.transport.abort()
                return
            delay = min(2 * delay, POLL_S[1])


def _kernel_unsent(transport) -> int:
    sock = transport.get_extra_info("socket")
    if _OUTQ is None or sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head or body is late, or
    whose client stopped reading. One timer per stage and connection, each holding its
    request's cycle only weakly."""

    header_timeout_s = DEFAULTS.header_timeout_s  # set per server by `http_protocol`
    body_timeout_s = DEFAULTS.body_timeout_s
    write_timeout_s = DEFAULTS.write_timeout_s
    send_buffer_bytes = DEFAULTS.send_buffer_bytes

    def connection_made(self, transport) -> None:
        self._timers: dict[str, object] = {}
        sock = transport.get_extra_info("socket")
        if sock is not None:  # fixed, not grown by the kernel for a client that reads nothing
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a new head (its task not started yet)
            cycle.scope.setdefault("extensions", {})[BACKLOG] = Backlog(self)
            if cycle.more_body:
                self._arm("body", self.body_timeout_s, self._close_if_body_late,
                          weakref.ref(cycle))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm("write", self.write_timeout_s, self._drop_if_still_paused)

    def resume_writing(self) -> None:
        super().resume_writing()
        timer = self._timers.pop("write", None)
        if timer is not None:
            timer.cancel()

    def _arm(self, stage: str, delay: float, callback, *args) -> None:
        if stage in self._timers:
            self._timers[stage].cancel()
        self._timers[stage] = self.loop.call_later(delay, callback, *args)

    def _arm_header_timer(self) -> None:
        """The cycle served so far, weakly: the head is late while no other cycle began."""
        served = weakref.ref(self.cycle) if self.cycle is not None else None
        self._arm("header", self.header_timeout_s, self._close_if_no_head, served)

    def _close_if_no_head(self, served) -> None:
        """No request head arrived since the timer was armed (the cycle is the same)."""
        served = served() if served is not None else None
        if self.cycle is served and not self.transport.is_closing() and (
                served is None or served.response_complete):
            log.debug("closing a connection that sent no request head in %.0f s",
                      self.header_timeout_s)
            self.transport.close()

    def _close_if_body_late(self, cycle_ref) -> None:
        """The request whose head started the timer still waits for the rest of its body."""
        cycle = cycle_ref()
        if cycle is None or cycle is not self.cycle or not cycle.more_body \
                or self.transport.is_closing():
            return
        log.debug("closing a connection whose request body was not complete in %.0f s",
                  self.body_timeout_s)
        if not cycle.response_started:
            self.transport.write(_timeout_response(self.body_timeout_s))
        self.transport.close()

    def _drop_if_still_paused(self) -> None:
        """The client has not drained the transport's buffer since writing paused: drop the
        connection (a close would wait for the unread bytes to be sent)."""
        self._timers.pop("write", None)
        if self.flow.write_paused:
            log.debug("dropping a connection whose client read nothing in %.0f s",
                      self.write_timeout_s)
            self.transport.abort()


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request body did not arrive in {seconds:g} s", "type":
        "invalid_request_error", "param": None, "code": "body_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


def http_protocol(bounds: ServerLimits) -> type[H11Protocol]:
    """A `BoundedH11` class with this server's timeouts."""
    return type("BoundedH11", (BoundedH11,), {
        "header_timeout_s": bounds.header_timeout_s, "body_timeout_s": bounds.body_timeout_s,
        "write_timeout_s": bounds.write_timeout_s, "send_buffer_bytes": bounds.send_buffer_bytes})


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
                            http=http_protocol(bounds))
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
