"""The replica path's liveness, on a local Ray (one CPU, no dashboard) with no engine replica
deployed: a stats board that fails turns `/health` to 503 within the stale time, however
fresh the figures kept from before; a replica retries its posts with a growing delay; a
replica without an engine fails its calls, and its health check once the server serves."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import ray
from starlette.testclient import TestClient

from specserve.engine.outputs import EngineStats
from specserve.models.tokenizer import from_hf_dir
from specserve.server.app import build_app
from specserve.server.preparation import ModelLimits
from specserve.server.replicas import deployment
from specserve.server.replicas.deployment import (EngineReplica, ReplicaInfo, StartFailure,
                                                  StatsBoard, post_delay)
from specserve.server.replicas.pool import STALE_S, ReplicaPool
from specserve.speculative.metrics import SpecMetrics


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=1, object_store_memory=80 << 20, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def stats() -> EngineStats:
    return EngineStats(0, 0, 0.0, 0, 10, 0, 0, 0, 0, SpecMetrics(), None, True)


def test_a_failed_stats_board_turns_health_503_within_the_stale_time(local_ray, model_dir):
    board = StatsBoard.remote()
    posting = threading.Event()

    def post() -> None:  # a live replica's posts, until the board is gone
        while not posting.wait(0.2):
            try:
                ray.get(board.post.remote(ReplicaInfo("r0", 1, "node", stats(), 0, time.time())))
            except Exception:  # noqa: BLE001 - killed
                return

    ray.get(board.post.remote(ReplicaInfo("r0", 1, "node", stats(), 0, time.time())))
    poster = threading.Thread(target=post)
    poster.start()
    pool = ReplicaPool(handle=None, board=board)
    tokenizer = from_hf_dir(model_dir, [])
    app, _ = build_app(pool, tokenizer, ModelLimits("tiny", 1024, tokenizer.vocab_size, False, 2))
    try:
        with TestClient(app) as client:
            deadline = time.monotonic() + 30  # until a refresh has seen a fresh post
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert client.get("/health").status_code == 200
            ray.kill(board)
            start = time.monotonic()
            while (health := client.get("/health")).status_code == 200 \
                    and time.monotonic() - start < STALE_S + 10:
                time.sleep(0.1)
            assert health.status_code == 503 and health.json()["status"] == "engine_dead"
            assert "stats board has not answered" in health.json()["reason"]
            assert STALE_S - 0.5 < time.monotonic() - start < STALE_S + 3
            assert pool.replicas  # the figures kept from before do not make it live
    finally:
        posting.set()
        poster.join()
        pool.shutdown(0)


def test_a_replica_retries_its_posts_with_a_growing_delay(local_ray, monkeypatch):
    assert [post_delay(f) for f in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    monkeypatch.setattr(deployment, "post_delay", lambda failures: 0.01 * 2 ** failures)
    replica = EngineReplica.__new__(EngineReplica)
    replica._stop, replica.replica, replica.served = threading.Event(), "r0", 0
    replica.engine = type("Engine", (), {"dead_reason": None, "stats": staticmethod(stats),
                                         "shutdown": lambda self, timeout: None})()
    tries = []

    def flaky_post(info):
        tries.append(time.monotonic())
        if len(tries) <= 3:
            raise ConnectionError("the board is restarting")
        replica._stop.set()  # the fourth post is taken: done
        return None

    replica._post = flaky_post
    replica._post_stats()
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) == 4 and gaps[0] < gaps[2]  # it kept trying, waiting longer each time


def test_a_replica_without_an_engine_fails_its_health_check_once_serving_and_its_calls(
        local_ray):
    replica = EngineReplica.__new__(EngineReplica)
    replica.engine, replica.replica, replica.board = None, "r0", StatsBoard.remote()
    replica.start_failure = StartFailure("os", "cannot map the weights")
    replica.check_health()  # starting: the serving process reads the failure from `describe`
    ray.get(replica.board.serve.remote())  # it read another replica's: it serves
    with pytest.raises(RuntimeError, match="has no engine.*cannot map the weights"):
        replica.check_health()

    async def first():
        return await anext(replica.stream([1, 2, 3], None, "req"))

    with pytest.raises(RuntimeError, match="has no engine"):
        asyncio.run(first())
