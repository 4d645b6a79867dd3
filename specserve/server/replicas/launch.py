"""Starting (or joining) Ray, deploying the engine replicas, and serving the one HTTP app over
them; the per-replica Prometheus figures.

Local (no --ray-address): a bounded Ray instance in this process's session: `num_cpus` = this
machine's cores, a small object store (deltas are small; nothing big goes through it), no
dashboard. Each replica asks for cores / N CPUs of the cluster (at least 1), so on a cluster of
equal machines `--replicas <machines>` places one replica per machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specserve.config import LLMConfig
from specserve.sampling.grammar import LazyGrammarCompiler
from specserve.server.config import ServerConfig

log = logging.getLogger("specserve.server")
APP_NAME = "specserve"
NAMESPACE = "specserve"
OBJECT_STORE_BYTES = 128 << 20
HEALTH_CHECK_PERIOD_S = 2.0


def _local_path(name):
    """Model arguments that are files or directories here become absolute paths (replica actors
    run in Ray's working directories); aliases stay as they are."""
    return str(Path(name).resolve()) if name is not None and Path(name).exists() else name


def llm_kwargs(config: LLMConfig) -> dict:
    """`LLM(...)`'s keyword arguments for each replica, model paths made absolute."""
    spec = config.speculative
    if spec is not None and spec.model is not None:
        spec = replace(spec, model=_local_path(spec.model))
    return dict(config.kwargs(), model=_local_path(str(config.load.model)),
                speculative_config=spec)


def serve_replicas(args: ServerConfig, config: LLMConfig) -> int:
    """Serve `config`'s LLM as `args.replicas` Ray Serve replicas behind one HTTP app."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise OSError(f"--replicas needs Ray Serve: pip install 'specserve[ray]' ({e})") from None
    from ray.serve.config import RequestRouterConfig

    from specserve.server.app import build_app
    from specserve.server.preparation import ModelLimits
    from specserve.server.replicas.deployment import EngineReplica, StatsBoard
    from specserve.server.replicas.pool import ReplicaPool
    from specserve.server.replicas.router import PrefixAffinityRouter
    from specserve.server.run import run_app

    start = time.perf_counter()
    if args.ray_address:
        ray.init(address=args.ray_address, namespace=NAMESPACE)
    else:
        # Ray starts workers at nice 15 (background priority): engines are the foreground work
        os.environ.setdefault("RAY_worker_niceness", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reporter process
        ray.init(num_cpus=os.cpu_count(), object_store_memory=OBJECT_STORE_BYTES,
                 include_dashboard=False, namespace=NAMESPACE)
    pool = None
    try:
        serve.start(proxy_location="Disabled")  # HTTP is served by this process (build_app)
        board = StatsBoard.remote()
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // args.replicas)
        deployment = serve.deployment(
            EngineReplica, name="EngineReplica", num_replicas=args.replicas,
            ray_actor_options={"num_cpus": cpus}, max_ongoing_requests=2 * config.engine.max_num_seqs,
            request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
            health_check_period_s=HEALTH_CHECK_PERIOD_S, graceful_shutdown_wait_loop_s=0.5,
            graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
            logging_config={"log_level": args.log_level.upper(),
                            "enable_access_log": args.access_log})
        handle = serve.run(deployment.bind(llm_kwargs(config), board, args.step_timeout),
                           name=APP_NAME, route_prefix=None)
        model = handle.describe.remote().result()
        if "start_failure" in model:  # every replica fails alike: say it once, as one process would
            raise model["start_failure"].exception()
        ray.get(board.serve.remote())  # from now on a replica without an engine fails its probe
        log.info("specserve: %d replica(s) of %s (%d CPU each) ready in %.1f s", args.replicas,
                 config.load.model, cpus, time.perf_counter() - start)
        limits = ModelLimits(args.served_model_name or str(config.load.model), model["max_model_len"],
                             model["vocab_size"], model["speculative"],
                             config.engine.max_num_seqs * args.replicas)  # the pool's slots
        pool = ReplicaPool(handle, board)
        grammars = LazyGrammarCompiler(model["tokenizer"], model["vocab_size"])  # checks only:
        threading.Thread(target=grammars.warm, daemon=True).start()  # each replica compiles
        app, state = build_app(pool, model["tokenizer"], limits, args.api_key, args.max_request_bytes,
                               args.limits(), compiler=grammars)
        state.metrics.registry.register(ReplicaCollector(pool, limits.name))
        asyncio.run(run_app(app, state, args))
    finally:
        if pool is not None:
            pool.shutdown(0)
        try:
            if args.ray_address:  # leave the cluster as we found it; a local Ray goes as a whole
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


class ReplicaCollector:
    """Per-replica figures with a `replica` label (the app's own metrics are the sums)."""

    def __init__(self, pool, model_name: str) -> None:
        self.pool, self.model = pool, model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica"]
        info = GaugeMetricFamily("specserve:replica_info", "1 per live engine replica (its process "
                                 "id and Ray node).", labels=labels + ["pid", "node"])
        running = GaugeMetricFamily("specserve:replica_num_requests_running", "Requests in the "
                                    "replica's running batch.", labels=labels)
        waiting = GaugeMetricFamily("specserve:replica_num_requests_waiting", "Requests waiting "
                                    "in the replica.", labels=labels)
        kv = GaugeMetricFamily("specserve:replica_kv_cache_usage_perc", "Fraction of the "
                               "replica's KV cache budget in use.", labels=labels)
        for r, p in sorted(self.pool.replicas.items()):
            info.add_metric([self.model, r, str(p.pid), p.node], 1)
            running.add_metric([self.model, r], p.stats.running)
            waiting.add_metric([self.model, r], p.stats.waiting)
            kv.add_metric([self.model, r], p.stats.kv_usage)
        routed = CounterMetricFamily("specserve:replica_requests", "Requests each replica served "
                                     "(counted at its first delta).", labels=labels)
        for r, n in sorted(self.pool.routed.items()):
            routed.add_metric([self.model, r], n)
        retried = CounterMetricFamily("specserve:replica_retried_requests", "Requests sent again "
                                      "because their replica failed before answering.",
                                      labels=["model_name"])
        retried.add_metric([self.model], self.pool.retried)
        failed = CounterMetricFamily("specserve:replica_failed_requests", "Requests ended with an "
                                     "error because their replica failed.", labels=["model_name"])
        failed.add_metric([self.model], self.pool.failed)
        yield from (info, running, waiting, kv, routed, retried, failed)
