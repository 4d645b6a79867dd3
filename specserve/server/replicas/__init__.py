"""`specserve serve --replicas N`: N engine replicas as Ray Serve deployments behind the one
OpenAI-compatible app of `specserve.server.app`.

Design (one codebase): the HTTP app is exactly the single-process one (`build_app`: the same
routes, validation, streaming, errors, page, API key, SIGTERM drain). It runs in the
`specserve serve` process and talks to an engine through the AsyncEngine interface
(stream / abort / stats / shutdown). With replicas, that engine is a `ReplicaPool`
(`pool.py`): every `stream` becomes a streaming call through a Ray Serve DeploymentHandle to the
`EngineReplica` deployment (`deployment.py`), each replica holding its own LLM + AsyncEngine.
Ray Serve routes (`router.py`: prefix affinity, else power of two choices), health-checks and
restarts replicas; the pool retries a request once when its replica died before a single delta
came back, and ends it with a clear error otherwise.

Nothing here imports Ray at module level, and `specserve.server.cli` imports this package only
when `--replicas` is given.
"""
