"""Ray Serve request router: the replica that holds the request's prefix, unless it is much busier
than the others; otherwise Ray's power of two choices (two random replicas, the shorter queue).

The pool (`pool.py`) knows prompts and which replica served what, so it names the preferred
replica in the call's `preferred_replica` keyword; this router only weighs that preference
against load. Ray's router probes the ranks in order and skips replicas whose queue is full
(`max_ongoing_requests`), so a full preferred replica falls through to the next rank.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

DEFAULT_IMBALANCE = 4  # ongoing requests the preferred replica may exceed the least loaded by


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs) -> None:
        self.imbalance = imbalance

    def _queue(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = _two_random(candidate_replicas)
        wanted = pending_request.kwargs.get("preferred_replica") if pending_request else None
        preferred = next((r for r in candidate_replicas if r.replica_id.unique_id == wanted), None)
        if preferred is None:
            return [two]
        least = min(self._queue(r) for r in candidate_replicas)
        if self._queue(preferred) - least > getattr(self, "imbalance", DEFAULT_IMBALANCE):
            return [two]
        return [[preferred], [r for r in two if r is not preferred] or two]


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
