"""`specserve serve`: its flags (`LLMConfig`'s and `ServerConfig`'s), loading the model pair, and
handing the app to the run loop (`server/run.py`), in this process or over Ray replicas."""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time

from specserve import default_speculation
from specserve.config import LLMConfig, add_llm_flags, speculative_config  # noqa: F401 (re-exported)
from specserve.engine.config import EngineConfig
from specserve.flags import add_flags, build, convert
from specserve.hub.registry import DEFAULT_DRAFT
from specserve.server.config import ServerConfig

log = logging.getLogger("specserve.server")
DESCRIPTION = """An OpenAI-compatible server. With no arguments it serves the default pair
(int4 target, int4 draft, hybrid lossless speculation) on 127.0.0.1:8000; any other --model
is served with the default draft only where their vocabularies match, else with suffix drafting
alone. On SIGTERM (or
Ctrl-C) it stops accepting, lets in-flight requests finish within --shutdown-timeout seconds,
aborts the rest (their streams end with finish_reason "abort"), and exits 0; a second SIGTERM
aborts them at once."""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, streaming, "
                       "metrics)", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_flags(p, default_speculation.of_args, title=f"speculative decoding (default: draft model "
                  f"{DEFAULT_DRAFT} for a target of its vocabulary, else suffix drafting; "
                  "cost-aware k, lossless)")
    add_flags(p.add_argument_group("HTTP, shutdown, replicas (Ray Serve; needs `pip install "
                                   "specserve[ray]`) and limits (what one request, one client "
                                   "and the server may ask for)"), ServerConfig)
    p.set_defaults(func=cmd_serve)


def parse_size(text: str | None) -> int | None:
    """`--kv-cache-memory`'s text as bytes: '2GiB' → 2147483648; '500MB' → 500000000."""
    return None if text is None else convert(EngineConfig, "kv_cache_memory", text)


def server_limits(args: argparse.Namespace):
    """The `ServerLimits` the flags ask for (`ServerConfig.limits`; ValueError naming the flag)."""
    return build(ServerConfig, args).limits()


def cmd_serve(args) -> int:
    server = build(ServerConfig, args)  # flags first; then, with no speculation flag, the default
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s:     %(message)s")
    config = LLMConfig.from_args(args)
    from specserve.llm import LLM
    from specserve.server.app import build_app
    from specserve.server.preparation import ModelLimits
    from specserve.server.run import run_app

    if server.replicas is not None:  # Ray is imported only here
        from specserve.server.replicas.launch import serve_replicas
        return serve_replicas(server, config)
    start = time.perf_counter()
    llm = LLM.from_config(config, defer_startup=True)  # timed on the engine's thread
    draft = f" + draft {llm.draft.path.name}" if llm.draft is not None else ""
    carried = f": {llm.target.carried}" if llm.target.carried else ""
    log.info("specserve: loaded %s%s (%s weights%s; speculation %s) in %.1f s",
             llm.target.path.name, draft, llm.target.weights, carried,
             config.speculative or "off", time.perf_counter() - start)
    engine = llm.async_engine(server.step_timeout)
    limits = ModelLimits(server.served_model_name or str(config.load.model),
                         llm.engine.config.max_model_len, llm.target.config.vocab_size,
                         llm.spec is not None, config.engine.max_num_seqs)
    # the engine's grammar compiler, built ahead of the first structured request (seconds for a
    # large vocabulary); requests are compiled on the preparation thread into its cache
    threading.Thread(target=llm.engine.grammars.warm, daemon=True).start()
    app, state = build_app(engine, llm.tokenizer, limits, server.api_key, server.max_request_bytes,
                           server.limits(), compiler=llm.engine.grammars)
    try:
        asyncio.run(run_app(app, state, server))
    finally:
        engine.shutdown(0)
    return 0
