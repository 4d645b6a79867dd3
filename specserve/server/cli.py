"""`specserve serve`: flags, loading the model pair, running uvicorn, and a graceful SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

from specserve.config import LLMConfig, add_llm_flags, speculative_config  # noqa: F401 (re-exported)
from specserve.engine.config import EngineConfig
from specserve.flags import add_flags, build, convert
from specserve.hub.registry import DEFAULT_DRAFT
from specserve.server.config import ServerConfig

log = logging.getLogger("specserve.server")
DESCRIPTION = """An OpenAI-compatible server. With no arguments it serves the default pair
(int4 target, int4 draft, cost-aware lossless speculation) on 127.0.0.1:8000. On SIGTERM (or
Ctrl-C) it stops accepting, lets in-flight requests finish within --shutdown-timeout seconds,
aborts the rest (their streams end with finish_reason "abort"), and exits 0."""
# the default speculation: the default draft, k chosen per round by the cost-aware policy
SPECULATION = {"method": "draft_model", "model": DEFAULT_DRAFT, "num_speculative_tokens": -1}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, streaming, "
                       "metrics)", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_flags(p, SPECULATION, title=f"speculative decoding (default: draft model "
                  f"{DEFAULT_DRAFT}, cost-aware k, lossless)")
    add_flags(p.add_argument_group("HTTP, shutdown and replicas (Ray Serve; needs "
                                   "`pip install specserve[ray]`)"), ServerConfig)
    p.set_defaults(func=cmd_serve)


def parse_size(text: str | None) -> int | None:
    """`--kv-cache-memory`'s text as bytes: '2GiB' → 2147483648; '500MB' → 500000000."""
    return None if text is None else convert(EngineConfig, "kv_cache_memory", text)


def cmd_serve(args) -> int:
    server = build(ServerConfig, args)
    config = LLMConfig.from_args(args)
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s:     %(message)s")
    from specserve.engine.async_engine import AsyncEngine
    from specserve.llm import LLM
    from specserve.server.app import build_app
    from specserve.server.preparation import ModelLimits

    if server.replicas is not None:  # Ray is imported only here
        from specserve.server.replicas.launch import serve_replicas
        return serve_replicas(server, config)
    start = time.perf_counter()
    llm = LLM.from_config(config)
    draft = f" + draft {llm.draft.path.name}" if llm.draft is not None else ""
    log.info("specserve: loaded %s%s (%s weights, speculation %s) in %.1f s", llm.target.path.name,
             draft, config.load.weights, config.speculative or "off", time.perf_counter() - start)
    engine = AsyncEngine.from_llm(llm)
    limits = ModelLimits(server.served_model_name or str(config.load.model),
                         llm.engine.config.max_model_len, llm.target.config.vocab_size,
                         llm.spec is not None)
    app, state = build_app(engine, llm.tokenizer, limits, server.api_key, server.max_request_bytes)
    try:
        asyncio.run(_serve(app, state, server))
    finally:
        engine.shutdown(0)
    return 0


async def _serve(app, state, args: ServerConfig) -> None:
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = uvicorn.Server(config)
    drain = asyncio.create_task(_drain_on_exit(server, state, args))
    # uvicorn restores the handlers it found and then re-raises the signal it caught: let that
    # land on a handler that does nothing, so a SIGTERM ends in a clean exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve()
        await drain
    finally:
        drain.cancel()


async def _drain_on_exit(server, state, args: ServerConfig) -> None:
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
