"""The Ray side: `EngineReplica` (one LLM + AsyncEngine per replica actor, streaming deltas) and
`StatsBoard` (a small actor the replicas post their EngineStats to, for `/metrics` and `/health`).

What crosses the wire: prompt token ids, SamplingParams and SpeculationOverride in; in return
`(replica id, RequestDelta)` pairs, or `(replica id, Failure)` when the request failed (bad input,
engine closing, engine error), so errors keep their meaning without depending on how Ray wraps
exceptions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import ray
from ray import serve

from specserve.clients.client import EngineClosed, EngineDead, EngineError

log = logging.getLogger("specserve.server")
STATS_PERIOD_S = 0.5
MAX_POST_DELAY_S = 8.0  # the longest wait between two posts while the board does not answer


@dataclass(frozen=True)
class Failure:
    kind: str  # "value" (bad input) | "closed" (shutting down) | "dead" (the replica's engine
    # is dead) | "engine" (failed in the engine)
    message: str

    @classmethod
    def of(cls, e: Exception) -> "Failure":
        kind = ("value" if isinstance(e, ValueError) else "closed" if isinstance(e, EngineClosed)
                else "dead" if isinstance(e, EngineDead) else "engine")
        return cls(kind, str(e))

    def exception(self, replica: str) -> Exception:
        if self.kind == "value":
            return ValueError(self.message)
        if self.kind == "closed":
            return EngineClosed(self.message)
        if self.kind == "dead":
            return EngineDead(f"replica {replica}: {self.message}")
        return EngineError(f"replica {replica}: {self.message}")


@dataclass(frozen=True)
class StartFailure:
    """Why a replica could not build its engine: the error the single-process server reports in
    one line (`specserve/cli.py`), carried back whole, so the serving process raises it once
    instead of Ray Serve restarting replicas that fail the same way."""

    kind: str  # "value" (exit 2, as a ValueError) | "os" (exit 1)
    message: str

    def exception(self) -> Exception:
        return ValueError(self.message) if self.kind == "value" else OSError(self.message)


@dataclass(frozen=True)
class ReplicaInfo:
    replica: str  # Ray Serve's replica id
    pid: int
    node: str
    stats: object  # EngineStats
    served: int  # requests this replica finished or aborted
    posted: float  # time.time() of the post


@ray.remote(num_cpus=0)
class StatsBoard:
    """The latest post of each replica, whether the serving process serves (it has read a
    replica's description: replicas started), and the drain order of a shutdown. Owned by the
    serving process (dies with it)."""

    def __init__(self) -> None:
        self._posts: dict[str, ReplicaInfo] = {}
        self._drain_deadline: float | None = None
        self._serving = False

    def serve(self) -> None:
        self._serving = True

    def serving(self) -> bool:
        return self._serving

    def post(self, info: ReplicaInfo) -> float | None:
        """Record a replica's figures; answer the drain deadline (time.time()) once set."""
        self._posts[info.replica] = info
        return self._drain_deadline

    def drain(self, deadline: float) -> None:
        self._drain_deadline = deadline

    def remove(self, replica: str) -> None:
        self._posts.pop(replica, None)

    def snapshot(self) -> dict[str, ReplicaInfo]:
        return dict(self._posts)


class EngineReplica:
    """One engine. Ray Serve makes N of these, restarts dead ones and routes calls to them."""

    def __init__(self, llm_kwargs: dict, board, step_timeout: float | None = None) -> None:
        from specserve.llm import LLM

        self._stop = threading.Event()  # first: __del__ finds it whatever fails below
        self.engine, self.start_failure, self.board = None, None, board
        self.replica = serve.get_replica_context().replica_id.unique_id
        _foreground_priority()
        try:  # the start-up work runs on the engine's thread, inside async_engine()
            self.llm = LLM(**llm_kwargs, defer_startup=True)
            self.engine = self.llm.async_engine(step_timeout)
        except (ValueError, OSError, MemoryError) as e:  # what the CLI reports in one line
            self.start_failure = StartFailure("value" if isinstance(e, ValueError) else "os",
                                              str(e))
            return
        self.served = 0
        self._poster = threading.Thread(target=self._post_stats, name="stats-poster", daemon=True)
        self._poster.start()
        log.info("specserve: replica %s (pid %d) ready", self.replica, os.getpid())

    def describe(self) -> dict:
        """What the HTTP process needs to validate requests without loading the model itself
        (or, where the engine could not be built, `{"start_failure": StartFailure}`)."""
        if self.start_failure is not None:
            return {"start_failure": self.start_failure}
        return {"tokenizer": self.llm.tokenizer, "max_model_len": self.llm.engine.config.max_model_len,
                "vocab_size": self.llm.target.config.vocab_size, "speculative": self.llm.spec is not None}

    async def stream(self, prompt_ids: list[int], params, request_id: str, speculation=None,
                     preferred_replica: str | None = None, client: str | None = None):
        """`(replica id, RequestDelta | Failure)` until the request finishes. Cancelled (the
        client went away, or the pool aborted it) → AsyncEngine.stream aborts the request. A
        replica without an engine raises before answering (the pool sends the request to
        another)."""
        if self.engine is None:
            raise RuntimeError(f"replica {self.replica} has no engine: {self.start_failure}")
        try:
            async for delta in self.engine.stream(prompt_ids, params, request_id=request_id,
                                                  speculation=speculation, client=client):
                yield self.replica, delta
        except (ValueError, EngineClosed, EngineError) as e:
            yield self.replica, Failure.of(e)
        finally:
            self.served += 1

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a dead engine fails it, and so does having none (a
        replica that could not build its engine) once the server serves; Ray Serve replaces the
        replica (meanwhile it posts no figures, so the pool stops routing to it). Before that
        it passes: where every replica fails to start alike, `describe` hands the error back and
        the serving process stops with it, instead of Ray Serve restarting replicas that fail
        the same way."""
        if self.engine is None:
            if ray.get(self.board.serving.remote(), timeout=10):
                raise RuntimeError(f"replica {self.replica} has no engine: {self.start_failure}")
            return
        if self.engine.dead_reason is not None:
            raise RuntimeError(f"replica {self.replica}: the engine is dead: {self.engine.dead_reason}")

    def _post_stats(self) -> None:
        """Post this replica's figures every `STATS_PERIOD_S` until the replica stops or its
        engine dies; a post the board does not take is tried again, waiting twice as long
        each time (at most `MAX_POST_DELAY_S`), so a board that comes back hears again."""
        node = ray.get_runtime_context().get_node_id()
        draining, failures = False, 0
        while not self._stop.wait(post_delay(failures)):
            if self.engine.dead_reason is not None:
                return
            try:
                deadline = self._post(ReplicaInfo(self.replica, os.getpid(), node,
                                                  self.engine.stats(), self.served, time.time()))
            except Exception as e:  # noqa: BLE001 - the board is busy, restarting, or gone
                failures += 1
                log.debug("replica %s: posting its figures failed (%r); trying again in %.1f s",
                          self.replica, e, post_delay(failures))
                continue
            failures = 0
            if deadline is not None and not draining:  # SIGTERM: finish within the bound, abort the rest
                draining = True
                threading.Thread(target=self.engine.shutdown, args=(max(0.0, deadline - time.time()),),
                                 name="drain", daemon=True).start()

    def _post(self, info: ReplicaInfo) -> float | None:
        return ray.get(self.board.post.remote(info), timeout=10)

    def __del__(self) -> None:
        """Ray Serve's graceful shutdown: in-flight requests were drained by the HTTP process."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(0)


def post_delay(failures: int) -> float:
    """Seconds before the next post after `failures` failed ones in a row."""
    return min(MAX_POST_DELAY_S, STATS_PERIOD_S * 2 ** failures)


def _foreground_priority() -> None:
    """Ray runs workers at nice 15 unless its cluster was started with RAY_worker_niceness=0; an
    engine at nice 15 gets a sliver of a busy machine. Back to 0 where allowed (threads made
    from here on, the engine's and OpenMP's, inherit it)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as e:  # no CAP_SYS_NICE: say how to fix it, serve anyway
        log.warning("specserve: replica runs at nice %d (%s); start Ray with RAY_worker_niceness=0",
                    os.getpriority(os.PRIO_PROCESS, 0), e)
