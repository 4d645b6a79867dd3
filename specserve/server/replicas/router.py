"""Ray Serve request router: the replica the call names (`preferred_replica`: the pool's choice,
the one that holds the request's prefix and is not much busier than the others), unless its
queue is full; otherwise Ray's power of two choices (two random replicas, the shorter queue).

The pool (`pool.py`) knows prompts, which replica served what and how many requests each has in
flight, so it weighs the prefix against load and names the replica; this router does not weigh
them again from Ray's queue-length cache, whose figures it trusts for seconds (the likely reason a
conversation's next turn once went away from its prefix right after a burst). Ray's router
probes the ranks in order and skips replicas whose queue is full (`max_ongoing_requests`), so a
full preferred replica falls through to the next rank.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = _two_random(candidate_replicas)
        wanted = pending_request.kwargs.get("preferred_replica") if pending_request else None
        preferred = next((r for r in candidate_replicas if r.replica_id.unique_id == wanted), None)
        if preferred is None:
            return [two]
        return [[preferred], [r for r in two if r is not preferred] or two]


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
