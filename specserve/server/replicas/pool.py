"""`ReplicaPool`: the `EngineClient` protocol (stream / abort / stats / health / shutdown) over
N Ray Serve engine replicas, so `build_app` serves them as it serves one `AsyncEngine`.

- stream: one streaming DeploymentHandle call per request, naming the replica that holds the
  longest recorded prefix of the prompt (`prefix.py`) when it covers at least half of it and
  that replica has no more than `IMBALANCE` requests beyond the least busy live replica (counted
  here, exactly: a request counts against the replica it was sent to prefer until its first
  delta names the one that took it, then against that one until it ends); Ray Serve's router
  (`router.py`) sends it there unless that replica's queue is full. When the call fails in Ray
  (the replica died, became unreachable) before any delta came back, it is sent again, once, to
  whichever replica the router picks; after that, or once deltas were streamed, the request
  ends with an EngineError naming the replica (the app turns it into a 500 `engine_error`, in
  the stream when streaming).
- a call that sends nothing for `call_timeout_s` (the replica stopped answering) counts as a
  failure in Ray: cancelled, and sent again if nothing had been streamed.
- no live replica (none posted to the board within `STALE_S`), or no figures at all for as
  long (the board has not answered a refresh since `STALE_S` ago: liveness counts from the
  last successful refresh, never from figures kept from before): `dead_reason` says so,
  `/health` answers 503 and requests are refused with `EngineDead` (503 `engine_dead`).
- abort: cancels the call; the replica's AsyncEngine aborts the request and frees its memory.
- stats: the sum over the replicas' latest posts to the StatsBoard (a post older than `stale_s`
  is a dead replica's and is dropped, with its prefixes).
- health: not shutting down, and at least one replica posted its stats lately.
- shutdown(timeout): no new requests; every replica's engine is told (through the board) to
  finish in-flight requests within `timeout` and abort the rest ("abort" deltas, as in one
  process); calls still open a little after that are cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid

import ray
from ray.exceptions import RayError

from specserve.clients.client import EngineClosed, EngineDead, EngineError
from specserve.engine.outputs import EngineStats
from specserve.server.replicas.deployment import Failure, ReplicaInfo
from specserve.server.replicas.prefix import PrefixIndex
from specserve.speculative.metrics import SpecMetrics

log = logging.getLogger("specserve.server")
REFRESH_S = 0.5
STALE_S = 3.0
MIN_AFFINITY = 0.5  # the held prefix must cover at least this fraction of the prompt
IMBALANCE = 4  # requests the preferred replica may have beyond the least busy one
CANCEL_GRACE_S = 2.0  # after the drain timeout, how long replicas get to send their "abort" deltas
CALL_TIMEOUT_S = 120.0  # the longest a call may go without a delta (a request waits for a slot)


class ReplicaPool:
    def __init__(self, handle, board, block: int = 16, retries: int = 1,
                 call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.handle, self.board, self.retries = handle, board, retries
        self.call_timeout_s = call_timeout_s
        self.index = PrefixIndex(block)
        self.replicas: dict[str, ReplicaInfo] = {}  # latest post per live replica
        self.routed: collections.Counter[str] = collections.Counter()  # requests each replica took
        self.busy: collections.Counter[str] = collections.Counter()  # requests in flight by replica
        self.retried = 0  # requests sent again after their replica failed before streaming
        self.failed = 0  # requests ended with an error because their replica failed
        self._inflight: dict[str, object] = {}  # request id -> DeploymentResponseGenerator
        self._lock = threading.Lock()
        self._closing = False
        self._refreshed = time.monotonic()  # of the last refresh the board answered
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="replica-stats", daemon=True)
        self._refresh()
        self._refresher.start()

    # ------------------------------------------------------------------ EngineClient
    async def stream(self, prompt: list[int], params, request_id: str | None = None, speculation=None,
                     client: str | None = None):
        if self._closing:
            raise EngineClosed("the server is shutting down and takes no new requests")
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        request_id = request_id or uuid.uuid4().hex
        preferred = self._preferred(prompt)
        for attempt in range(self.retries + 1):
            call = self.handle.options(stream=True).stream.remote(
                prompt, params, request_id, speculation, preferred_replica=preferred,
                client=client)
            self._inflight[request_id] = call
            replica, received, finished = None, False, False
            holder = preferred  # the replica this request counts against in `busy`
            if holder is not None:
                self.busy[holder] += 1
            try:
                async for replica, item in _within(self.call_timeout_s, call):
                    if isinstance(item, Failure):
                        raise item.exception(replica)
                    if not received:
                        received = True
                        self.routed[replica] += 1
                        holder = self._move_busy(holder, replica)
                    if item.finished:
                        finished = True
                        self._remember(prompt, replica, item)
                    yield item
                    if finished:
                        return
                raise EngineError(f"replica {replica} ended request {request_id} unfinished")
            except (RayError, TimeoutError) as e:
                if received or attempt == self.retries or self._closing:
                    self.failed += 1
                    what = "after streaming part of it" if received else "and the retry failed too"
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    raise EngineError(f"engine replica {replica or '(unknown)'} failed while serving "
                                      f"request {request_id} {what}: {type(e).__name__}: "
                                      f"{reason}") from None  # Ray's text says it all; no traceback
                self.retried += 1
                preferred = None
                log.warning("request %s: replica failed before answering (%s); sending it again",
                            request_id, type(e).__name__)
            finally:
                self._inflight.pop(request_id, None)
                self._move_busy(holder, None)
                if not finished:
                    call.cancel()

    def abort(self, request_id: str) -> None:
        call = self._inflight.get(request_id)
        if call is not None:
            call.cancel()

    def stats(self) -> EngineStats:
        return merge_stats([r.stats for r in self.replicas.values()])

    def health(self) -> bool:
        return not self._closing and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """None while some replica is live, as of a refresh within `STALE_S`; else why none
        can serve."""
        if self._closing:
            return None
        silent = time.monotonic() - self._refreshed
        if silent > STALE_S:
            return (f"no news of the engine replicas: their stats board has not answered for "
                    f"{silent:.0f} s")
        if not self.replicas:
            return f"no live engine replica (none reported within {STALE_S:g} s)"
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        if not self._closing:
            self._closing = True
            deadline = time.time() + (timeout if timeout is not None else 365 * 86400)
            try:
                ray.get(self.board.drain.remote(deadline), timeout=10)
            except Exception as e:  # noqa: BLE001 - the board is gone: replicas are gone too
                log.warning("could not ask the replicas to drain: %r", e)
            end = deadline + CANCEL_GRACE_S
            while self._inflight and time.time() < end:
                time.sleep(0.05)
            for call in list(self._inflight.values()):
                call.cancel()
        self._stop.set()

    # ------------------------------------------------------------------ internals
    def _preferred(self, prompt) -> str | None:
        if not isinstance(prompt, list) or not prompt:
            return None
        match = self.index.lookup(prompt, alive=set(self.replicas))
        if match.tokens < MIN_AFFINITY * len(prompt):
            return None
        return prefer(match.replica, self.busy, set(self.replicas))

    def _move_busy(self, holder: str | None, to: str | None) -> str | None:
        """Move a request's count in `busy` from `holder` to `to` (None: nowhere)."""
        if holder is not None:
            self.busy[holder] -= 1
            if self.busy[holder] <= 0:
                del self.busy[holder]
        if to is not None:
            self.busy[to] += 1
        return to

    def _remember(self, prompt, replica: str, delta) -> None:
        if isinstance(prompt, list) and delta.output is not None and delta.output.outputs:
            self.index.record(prompt + list(delta.output.outputs[0].token_ids), replica)

    def _refresh(self) -> None:
        posts = ray.get(self.board.snapshot.remote(), timeout=10)
        now = time.time()
        live = {r: info for r, info in posts.items() if now - info.posted < STALE_S}
        for gone in set(self.replicas) - set(live):
            self.index.forget(gone)
        for stale in set(posts) - set(live):
            self.board.remove.remote(stale)
        self.replicas = live
        self._refreshed = time.monotonic()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._refresh()
            except Exception as e:  # noqa: BLE001 - retried next period; `dead_reason` counts
                log.debug("replica stats refresh failed: %r", e)  # from the last success


def prefer(replica: str | None, busy: collections.Counter, alive: set[str],
           imbalance: int = IMBALANCE) -> str | None:
    """`replica` (the one holding the prompt's prefix) unless it has more than `imbalance`
    requests in flight beyond the least busy live replica: then None (any replica)."""
    if replica is None:
        return None
    least = min((busy[r] for r in alive), default=0)
    return replica if busy[replica] - least <= imbalance else None


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    """The replicas' EngineStats as one engine's: counts and totals add up, KV usage is blocks
    used over blocks total, the rolling acceptance is the mean of those that have one, and the
    pool is healthy only when it has replicas and every one of them is."""
    spec = SpecMetrics()
    for p in parts:
        spec.merge(p.spec)
    total = sum(p.kv_blocks_total for p in parts)
    used = sum(p.kv_blocks_used for p in parts)
    rolling = [p.rolling_acceptance for p in parts if p.rolling_acceptance is not None]
    return EngineStats(
        running=sum(p.running for p in parts), waiting=sum(p.waiting for p in parts),
        kv_usage=used / total if total else 0.0, kv_blocks_used=used, kv_blocks_total=total,
        preemptions=sum(p.preemptions for p in parts), aborted=sum(p.aborted for p in parts),
        prefix_cache_hit_tokens=sum(p.prefix_cache_hit_tokens for p in parts),
        prompt_tokens_computed=sum(p.prompt_tokens_computed for p in parts), spec=spec,
        kv_touched_bytes=sum(p.kv_touched_bytes for p in parts),
        rolling_acceptance=sum(rolling) / len(rolling) if rolling else None,
        healthy=bool(parts) and all(p.healthy for p in parts))


async def _within(timeout_s: float, call):
    """The items of a streaming call, each within `timeout_s` of the last (TimeoutError)."""
    iterator = call.__aiter__()
    while True:
        try:
            item = await asyncio.wait_for(iterator.__anext__(), timeout_s)
        except StopAsyncIteration:
            return
        yield item
