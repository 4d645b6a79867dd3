"""The engine on a background thread, for servers: requests in and deltas out at any time.

A thread runs `LLMEngine.step()` while there is work and sleeps on a condition otherwise.
`add` and `abort` may be called from any thread (they go through the engine's inbox);
`stream` is an async iterator of one request's `RequestDelta`s for asyncio code, fed with
`loop.call_soon_threadsafe`. Leaving the iterator early (the client went away) aborts the
request and frees its memory. An exception inside a step fails only the requests that were
running in it (their streams raise `EngineError`); the engine keeps serving the others.

Liveness: if the thread itself dies (an exception no step could pin on requests, e.g. a
`BaseException` from a kernel binding) or a step runs longer than `step_timeout` seconds
(`StepWatchdog`), the engine is dead: every open request ends at once with `EngineDead`,
every new one is refused with it, and `dead_reason` says why. The engine does not end the
process: a stuck thread cannot be stopped or joined, and a server that stays up can still
answer every client (503 `engine_dead`) and its health probe (503), which is what a
supervisor restarts on; exiting would drop the answers owed to open streams.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from specserve.engine.client import EngineClosed, EngineDead, EngineError
from specserve.engine.engine import LLMEngine
from specserve.engine.outputs import EngineStats, RequestDelta, RequestOutput, SpeculationOverride
from specserve.engine.watchdog import StepWatchdog
from specserve.sampling.params import SamplingParams

IDLE_WORK_AFTER_S = 5.0  # idle seconds before an engine's idle work runs (doubling after each)
IDLE_WORK_MAX_S = 600.0

__all__ = ["AsyncEngine", "EngineClosed", "EngineDead", "EngineError", "engine_stats"]
log = logging.getLogger(__name__)

DeltaCallback = Callable[[RequestDelta], None]


class AsyncEngine:
    """Runs an LLMEngine's steps on a background thread; add/abort from any thread or asyncio.

    E.g. `engine = LLM(...).async_engine()`, then in a coroutine
    `async for delta in engine.stream("Hello", SamplingParams(max_tokens=32)): ...`.
    While it runs an LLM's engine, that LLM's `generate`/`chat` go through it too (so they run
    concurrently with streams and with each other), until `shutdown`. `step_timeout`: the
    seconds one step may take before the engine counts as dead (None: no watchdog). It
    implements `EngineClient`."""

    def __init__(self, engine: LLMEngine, step_timeout: float | None = None) -> None:
        self.engine = engine
        self._callbacks: dict[str, DeltaCallback] = {}
        self._lock = threading.Lock()  # guards _callbacks
        self._wake = threading.Condition()  # work arrived / a step ended
        self._closing = False  # no new requests
        self._stopping = False  # the thread exits once idle
        self._stats = engine_stats(engine)
        self._dead: str | None = None  # why the engine serves no more
        self._watchdog = (StepWatchdog(step_timeout, self._overran) if step_timeout is not None
                          else None)
        self._idle_after = IDLE_WORK_AFTER_S  # idle seconds before the engine's idle work
        self._started = threading.Event()  # the engine's start-up work ran on the thread
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @staticmethod
    def from_llm(llm, step_timeout: float | None = None) -> AsyncEngine:
        """`llm.async_engine(step_timeout)`: the LLM creates and tracks the AsyncEngine that
        runs its engine. (Kept for existing callers; `LLM.async_engine` is the way.)"""
        return llm.async_engine(step_timeout)

    # ------------------------------------------------------------------ requests
    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
            speculation: SpeculationOverride | None = None,
            on_delta: DeltaCallback | None = None, text: str | None = None) -> str:
        """Queue a request from any thread; `on_delta` is called on the engine thread with each
        of its deltas (`text`: the prompt's text to report when `prompt` is token ids).
        Invalid input raises ValueError naming the field."""
        if self.dead_reason is not None:
            raise EngineDead(f"the engine is dead: {self.dead_reason}")
        if self._closing:
            raise EngineClosed("the engine is shutting down")
        prompt_ids = self._encode(prompt)
        self.engine.check_request(prompt_ids, params, speculation)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        with self._lock:
            if request_id in self._callbacks or self.engine.has_request(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            if on_delta is not None:
                self._callbacks[request_id] = on_delta
        try:
            self.engine.add_request(prompt_ids, params, request_id,
                                    prompt if isinstance(prompt, str) else text, speculation)
        except BaseException:
            with self._lock:
                self._callbacks.pop(request_id, None)
            raise
        if self._dead is not None:  # it died while this request was being added
            self._die(self._dead)
        self._notify()
        return request_id

    def abort(self, request_id: str) -> None:
        """Finish a request with "abort" and free its memory (any thread, any moment)."""
        self.engine.abort_request(request_id)
        self._notify()

    def generate(self, requests: list[tuple[list[int], SamplingParams, str | None]]
                 ) -> list[RequestOutput]:
        """Run `(prompt ids, params, prompt text)` requests to the end and return their outputs
        in order, blocking the calling thread (not the engine's). Any exception or interrupt
        while waiting aborts them; a request that failed in the engine raises its error."""
        if not requests:
            return []
        finals: dict[str, RequestDelta] = {}
        guard, all_done = threading.Lock(), threading.Event()

        def on_delta(delta: RequestDelta) -> None:
            if delta.finished:
                with guard:
                    finals[delta.request_id] = delta
                    if len(finals) == len(requests):
                        all_done.set()

        ids: list[str] = []
        try:
            for prompt_ids, params, text in requests:
                ids.append(self.add(prompt_ids, params, on_delta=on_delta, text=text))
            all_done.wait()
        except BaseException:
            for rid in ids:
                if rid not in finals:
                    self.abort(rid)
            raise
        for rid in ids:
            if finals[rid].error is not None:
                raise finals[rid].error
        return [finals[rid].output for rid in ids]

    async def stream(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None,
                     speculation: SpeculationOverride | None = None
                     ) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas until it finishes. Validates on the first
        iteration (ValueError naming the field); leaving early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()

        def deliver(delta: RequestDelta) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, delta)
            except RuntimeError:  # the loop is closed: nobody listens any more
                self.engine.abort_request(delta.request_id)

        rid = self.add(prompt, params, request_id, speculation, on_delta=deliver)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                if isinstance(delta.error, (EngineClosed, EngineDead)):
                    raise delta.error
                if delta.error is not None:
                    raise EngineError(f"request {rid} failed in the engine: "
                                      f"{delta.error!r}") from delta.error
                yield delta
        finally:
            with self._lock:
                self._callbacks.pop(rid, None)
            if not finished:
                self.abort(rid)

    # ------------------------------------------------------------------ state
    def stats(self) -> EngineStats:
        """The engine's state after its last step (running, waiting, KV use, speculation)."""
        return self._stats

    def health(self) -> bool:
        """True while it takes requests and its engine is alive (see `dead_reason`)."""
        return not self._closing and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """None while the engine serves; else why it never will again (see the module)."""
        if self._dead is None and not self._thread.is_alive() and not self._stopping:
            return "the engine thread stopped"
        return self._dead

    @property
    def stopped(self) -> bool:
        """True once its thread has ended (shut down, or died): it runs its engine no more."""
        return not self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Take no new requests; let the ones in flight finish for up to `timeout` seconds
        (None: as long as they need), then abort the rest ("abort") and stop the thread."""
        self._closing = True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while (self.engine.has_unfinished() and self._thread.is_alive()
                   and self._dead is None):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(left)
        for rid in self.engine.request_ids():
            self.engine.abort_request(rid)
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._dead is None:
            self._thread.join()  # a stuck step's thread is left behind: it is a daemon

    # ------------------------------------------------------------------ the thread
    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _run(self) -> None:
        try:  # the engine's deferred start-up work, on the thread that runs every step
            self.engine.run_startup()
        except BaseException as e:  # noqa: BLE001 - raised in the constructor
            self._startup_error = e
            self._started.set()
            return
        self._started.set()
        crashed = True
        try:
            while self._next_step():
                pass
            crashed = False
        except BaseException as e:
            log.critical("the engine thread died: %r", e, exc_info=e)
            raise
        finally:  # a crash of the thread itself must not leave streams waiting forever
            if crashed:
                self._die("the engine thread died")
            else:
                self._fail_listeners(EngineClosed("the engine thread stopped"))

    def _overran(self, seconds: float) -> None:
        """The watchdog's call: a step has run `seconds`, beyond the timeout."""
        log.critical("an engine step has run for %.1f s (step timeout %.1f s): the engine is "
                     "dead", seconds, self._watchdog.timeout)
        self._die(f"an engine step ran for more than {self._watchdog.timeout:g} s")

    def _die(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._fail_listeners(EngineDead(f"the engine is dead: {self._dead}"))
        self._notify()

    def _fail_listeners(self, error: Exception) -> None:
        with self._lock:
            orphans, self._callbacks = self._callbacks, {}
        for rid, callback in orphans.items():
            try:
                callback(RequestDelta(rid, [], True, None, error))
            except Exception:  # noqa: BLE001 - the others must still hear of it
                log.exception("delta callback for request %s failed", rid)

    def _next_step(self) -> bool:
        """Wait for work, run one step, hand out its deltas; False once stopped and idle."""
        if not self._await_work():
            return False
        if self._watchdog is not None:
            self._watchdog.started()
        try:
            deltas = self.engine.step()
            self._stats = engine_stats(self.engine)
        except Exception as error:  # noqa: BLE001 - the engine's own failures are in deltas
            log.exception("engine step failed outside the requests")
            deltas = self._fail_everything(error)
        if self._watchdog is not None:
            self._watchdog.finished()
        if self._dead is not None:  # the watchdog gave up on this step while it ran
            for rid in self.engine.request_ids():
                self.engine.abort_request(rid)
            return False
        for delta in deltas:
            self._deliver(delta)
        with self._wake:
            self._wake.notify_all()
        return True

    def _await_work(self) -> bool:
        """Wait until there is work (True) or the engine stops idle (False). An engine with
        work for an idle moment (`LLMEngine.run_idle_work`) runs it once it has been idle
        `self._idle_after` seconds (times a random 1-2: two engines that started together on
        one machine must not retry their timed passes together), outside the condition
        (requests still arrive meanwhile; the work stops for them), and waits twice as long
        before trying again, up to `IDLE_WORK_MAX_S`."""
        while True:
            with self._wake:
                since = time.monotonic()
                patience = self._idle_after * random.uniform(1.0, 2.0)
                while not self.engine.has_unfinished() and not self._stopping:
                    if self.engine.idle_work is None:
                        self._wake.wait()
                        continue
                    left = patience - (time.monotonic() - since)
                    if left <= 0:
                        break
                    self._wake.wait(left)
                else:
                    return self.engine.has_unfinished()
            self.engine.run_idle_work()
            self._idle_after = min(2 * self._idle_after, IDLE_WORK_MAX_S)

    def _deliver(self, delta: RequestDelta) -> None:
        with self._lock:
            callback = self._callbacks.get(delta.request_id)
            if delta.finished:
                self._callbacks.pop(delta.request_id, None)
        if callback is not None:
            try:
                callback(delta)
            except Exception:  # noqa: BLE001 - one listener must not stop the engine
                log.exception("delta callback for request %s failed", delta.request_id)

    def _fail_everything(self, error: Exception) -> list[RequestDelta]:
        """A failure the step could not pin on its requests: end every request with it."""
        with self._lock:
            rids = list(self._callbacks)
        for rid in self.engine.request_ids():
            self.engine.abort_request(rid)
        return [RequestDelta(rid, [], True, None, error) for rid in rids]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                return self.engine.tokenizer.encode(prompt)
            except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate
                raise ValueError(f"prompt cannot be tokenized: {e}") from None
        if not isinstance(prompt, list):
            raise ValueError(f"prompt must be a str or a list of int token ids, "
                             f"got {type(prompt).__name__}")
        return prompt


def engine_stats(engine: LLMEngine) -> EngineStats:
    """A snapshot of `engine` (read between steps, on the engine thread)."""
    scheduler = engine.scheduler
    used, total = engine.kv_blocks_used, engine.kv_blocks_total
    window = engine.metrics.window
    return EngineStats(
        running=len(scheduler.running), waiting=len(scheduler.waiting),
        kv_usage=used / total if total else 0.0, kv_blocks_used=used, kv_blocks_total=total,
        preemptions=engine.preemptions, aborted=engine.num_aborted,
        prefix_cache_hit_tokens=engine.prefix_cache_hit_tokens,
        prompt_tokens_computed=engine.prompt_tokens_computed,
        spec=copy.deepcopy(engine.metrics.total), rolling_acceptance=window.acceptance_rate,
        healthy=window.healthy, kv_touched_bytes=engine.kv_touched_bytes)
