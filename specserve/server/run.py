"""The server's run loop: uvicorn serving the app, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) it stops accepting (`/health` answers 503, new requests get 503), lets
in-flight requests finish within `shutdown_timeout` seconds, aborts the rest (their streams end
with finish_reason "abort") through the `EngineClient`, and returns, for an exit 0; a second
SIGTERM aborts them at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from specserve.server.app import ServerState
from specserve.server.config import ServerConfig

log = logging.getLogger("specserve.server")
FORCED_END_S = 2.0  # after a forced exit, how long open streams get to send their "abort" end


async def run_app(app, state: ServerState, args: ServerConfig) -> None:
    """Serve `app` with uvicorn (bounded by `state.bounds`, see `server/http.py`) until SIGTERM
    or Ctrl-C, then drain (see the module docstring)."""
    from specserve.server import http

    http.warn_if_exposed(args.host, args.api_key, state.bounds)
    freeze_heap()
    server = http.server(app, args.host, args.port, state.bounds, args.log_level,
                         args.access_log, args.shutdown_timeout + 5)
    drain = asyncio.create_task(_drain_on_exit(server, state, args))
    # uvicorn restores the handlers it found and then re-raises the signal it caught: let that
    # land on a handler that does nothing, so a SIGTERM ends in a clean exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve()
        if server.force_exit:  # a second signal: abort everything now
            await asyncio.to_thread(state.engine.shutdown, 0)
            await _streams_ended(server, FORCED_END_S)
        await drain
    finally:
        drain.cancel()


def freeze_heap() -> None:
    """Move everything alive once the model is loaded (the weights' Python objects, the
    tokenizer's, the imported modules': 220k objects for the default pair) out of the cyclic
    collector's sight. Every full collection walked them all, about 0.12 s with the GIL held,
    so a request that allocates many objects (a long conversation's body) stalled the event
    loop and the engine's step for that long each time one ran."""
    gc.collect()
    gc.freeze()


async def _streams_ended(server, timeout: float) -> None:
    """Wait (at most `timeout` s) for the responses still open to end: an aborted stream's last
    events (finish_reason "abort", `[DONE]`) go out before the process does."""
    tasks = [t for t in server.server_state.tasks if not t.done()]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


async def _drain_on_exit(server, state: ServerState, args: ServerConfig) -> None:
    """Once uvicorn is asked to exit: refuse new requests, give in-flight ones their time, abort
    the rest. uvicorn meanwhile stops accepting connections and waits for open ones to finish."""
    while not server.started and not server.should_exit:
        await asyncio.sleep(0.05)
    if server.started:
        log.info("specserve: serving %r on http://%s:%d (OpenAPI schema at /openapi.json)",
                 state.limits.name, args.host, args.port)
    while not server.should_exit:
        await asyncio.sleep(0.05)
    state.accepting = False
    stats = state.engine.stats()
    log.info("specserve: shutting down; %d running and %d waiting requests get %.0f s to finish",
             stats.running, stats.waiting, args.shutdown_timeout)
    await asyncio.to_thread(state.engine.shutdown, args.shutdown_timeout)
    log.info("specserve: engine stopped")
