"""`specserve serve`: flags, loading the model pair, running uvicorn, and a graceful SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import time

from specserve.hub.registry import DEFAULT_DRAFT, DEFAULT_TARGET

log = logging.getLogger("specserve.server")
DESCRIPTION = """An OpenAI-compatible server. With no arguments it serves the default pair
(int4 target, int4 draft, hybrid lossless speculation) on 127.0.0.1:8000; any other --model
is served with the default draft only where their vocabularies match, else with suffix drafting
alone. On SIGTERM (or
Ctrl-C) it stops accepting, lets in-flight requests finish within --shutdown-timeout seconds,
aborts the rest (their streams end with finish_reason "abort"), and exits 0; a second SIGTERM
aborts them at once."""
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
         "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, streaming, "
                       "metrics)", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_TARGET, help="target: alias, GGUF file or HF directory "
                   f"(default {DEFAULT_TARGET})")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` "
                   "(default: --model as given)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "float32", "int8", "int4"],
                   help="auto (default, the fast path): a quantized GGUF file stays quantized "
                        "(int4-style), a float checkpoint loads bf16")
    g = p.add_argument_group("speculative decoding (default: draft model "
                             f"{DEFAULT_DRAFT} for a target of its vocabulary, else ngram; "
                             "cost-aware k, lossless)")
    g.add_argument("--draft-model", default=None, help="the draft: alias, GGUF file or HF directory")
    g.add_argument("--speculative-config", default=None,
                   help='JSON in vLLM\'s shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--no-speculation", action="store_true", help="plain target decoding only")
    g = p.add_argument_group("capacity")
    g.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    g.add_argument("--max-model-len", type=int, default=4096, help="context length (prompt + output)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB "
                   "(default: the engine's, from available RAM)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per engine step (prefill chunks + decode rows)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="KV cache dtype (auto: float16 on the native kernels, else the "
                        "activations' dtype)")
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: "
                        "$SPECSERVE_API_KEY; none: open)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request body")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--no-access-log", action="store_true")
    g = p.add_argument_group("replicas (Ray Serve; needs `pip install specserve[ray]`)")
    g.add_argument("--replicas", type=int, default=None, help="serve N engine replicas as Ray Serve "
                   "deployments behind this one endpoint (default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. ray://head:10001 "
                   "or auto) instead of starting a local Ray instance")
    add_limit_flags(p)
    p.set_defaults(func=cmd_serve)


def speculative_config(args) -> dict | None:
    """The speculative config the flags ask for (ValueError on contradictory flags)."""
    if args.no_speculation:
        if args.draft_model or args.speculative_config:
            raise ValueError("--no-speculation contradicts --draft-model / --speculative-config")
        return None
    if args.speculative_config:
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError("--speculative-config must be a JSON object")
        if args.draft_model:
            config = {**config, "method": "draft_model", "model": args.draft_model}
        return config
    if args.draft_model:
        return {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": -1}
    from specserve.server import default_speculation

    config, reason = default_speculation.decide(args.model, DEFAULT_DRAFT)
    log.info("specserve: %s", reason)
    return config


def parse_size(text: str | None) -> int | None:
    """'2GiB' → 2147483648; '500MB' → 500000000; '1024' → 1024 bytes."""
    if text is None:
        return None
    m = SIZE.match(text)
    if not m:
        raise ValueError(f"--kv-cache-memory must be a size like 2GiB or 512MiB, got {text!r}")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * UNITS[unit])


def check_args(args) -> None:
    for name in ("port", "max_num_seqs", "max_model_len", "max_request_bytes", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.port > 65535:
        raise ValueError(f"--port must be <= 65535, got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.ray_address is not None and args.replicas is None:
        raise ValueError("--ray-address needs --replicas")


def cmd_serve(args) -> int:
    check_args(args)
    bounds = server_limits(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    kv_bytes = parse_size(args.kv_cache_memory)
    spec = speculative_config(args)  # flags first; then, with none, the default's choice
    from specserve.engine.async_engine import AsyncEngine
    from specserve.llm import LLM
    from specserve.server.app import build_app
    from specserve.server.preparation import ModelLimits

    budgets = {k: v for k, v in (("kv_cache_memory", kv_bytes),
                                 ("max_num_batched_tokens", args.max_num_batched_tokens),
                                 ("kv_cache_dtype", args.kv_cache_dtype)) if v is not None}
    if args.replicas is not None:  # Ray is imported only here
        from specserve.server.replicas.launch import serve_replicas
        return serve_replicas(args, spec, budgets)
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, speculative_config=spec, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, weights=args.weights, **budgets)
    draft = f" + draft {llm.draft.path.name}" if llm.draft is not None else ""
    log.info("specserve: loaded %s%s (%s weights, speculation %s) in %.1f s", llm.target.path.name,
             draft, args.weights, spec or "off", time.perf_counter() - start)
    engine = AsyncEngine.from_llm(llm, step_timeout=args.step_timeout)
    limits = ModelLimits(args.served_model_name or str(args.model), llm.engine.config.max_model_len,
                         llm.target.config.vocab_size, llm.spec is not None, args.max_num_seqs)
    app, state = build_app(engine, llm.tokenizer, limits, args.api_key, args.max_request_bytes,
                           bounds)
    try:
        asyncio.run(_serve(app, state, args))
    finally:
        engine.shutdown(0)
    return 0


async def _serve(app, state, args) -> None:
    from specserve.server import http

    http.warn_if_exposed(args.host, args.api_key, state.bounds)
    server = http.server(app, args.host, args.port, state.bounds, args.log_level,
                         not args.no_access_log, args.shutdown_timeout + 5)
    drain = asyncio.create_task(_drain_on_exit(server, state, args))
    # uvicorn restores the handlers it found and then re-raises the signal it caught: let that
    # land on a handler that does nothing, so a SIGTERM ends in a clean exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve()
        if server.force_exit:  # a second signal: abort everything now
            await asyncio.to_thread(state.engine.shutdown, 0)
        await drain
    finally:
        drain.cancel()


async def _drain_on_exit(server, state, args) -> None:
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


def add_limit_flags(p) -> None:
    """Flags of `ServerLimits` (server/limits.py) and the engine's step watchdog."""
    from specserve.server.limits import ServerLimits

    d = ServerLimits()
    g = p.add_argument_group("limits (what one request, one client and the server may ask for)")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting, help="sequences admitted "
                   "beyond the engine's slots; beyond them requests get 429 with Retry-After")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may run before it is aborted with 504 (default: none)")
    g.add_argument("--max-slot-share", type=float, default=d.max_slot_share,
                   help="share of the sequence slots one request may hold at once")
    g.add_argument("--max-choices", type=int, default=d.max_choices, help="prompts × n per request")
    g.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="characters of prompt text per request, checked before tokenizing")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="read special tokens' text in prompts and messages as the tokens "
                        "(default: as text)")
    g.add_argument("--allowed-hosts", default=",".join(d.allowed_hosts),
                   help="comma-separated Host names the server answers to, besides the --host "
                        "address itself ('*': any)")
    g.add_argument("--max-connections", type=int, default=d.max_connections)
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s)
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection gets to send a request head")
    g.add_argument("--step-timeout", type=float, default=300.0, help="seconds one engine step may "
                   "take before the engine counts as dead (503 engine_dead, /health 503)")


def server_limits(args):
    """The `ServerLimits` the flags ask for (ValueError naming the flag's field)."""
    from specserve.server.limits import ServerLimits

    if args.step_timeout is not None and not args.step_timeout > 0:
        raise ValueError(f"--step-timeout must be > 0 seconds, got {args.step_timeout}")

    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    bound = args.host.strip("[]").lower()
    if hosts and bound not in ("0.0.0.0", "::", "") and bound not in hosts:
        hosts += (bound,)  # the address it binds, as a literal, names this server
    return ServerLimits(
        max_choices=args.max_choices, max_prompt_chars=args.max_prompt_chars,
        max_slot_share=args.max_slot_share, request_timeout=args.request_timeout,
        max_waiting=args.max_waiting, special_tokens_in_prompts=args.allow_special_tokens,
        allowed_hosts=hosts,
        max_connections=args.max_connections, keep_alive_s=args.keep_alive_timeout,
        header_timeout_s=args.header_timeout)
