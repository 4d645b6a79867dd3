"""The engine on a background thread, for servers: requests in and deltas out at any time.

The thread owns the engine: it drains an inbox of adds and aborts (which any thread may
post), runs `LLMEngine.step()` while there is work, snapshots the statistics, and hands each
delta to its request's listener; with nothing to do it sleeps on a condition. So every
mutation of the engine happens on that one thread. `stream` is an async iterator of one
request's `RequestDelta`s for asyncio code, fed with `loop.call_soon_threadsafe`; leaving it
early aborts the request. An exception inside a step fails only the requests running in it.

Paced by the reader: a stream whose reader leaves `HOLD_AFTER` deltas untaken (the code that
drives it is waiting on its own reader, e.g. an HTTP client that stops reading) has its
request held in the engine (`LLMEngine.hold_request`: not scheduled, its slots to others);
once the reader has taken all but `HOLD_AFTER // 2` the request is released. Both are
decided on the event loop, which sees every delta arrive and every take, and posted to the
engine thread in order. `generate` and callbacks are never held.

Liveness: if the thread dies, or a step or the idle work runs longer than `step_timeout`
seconds (`StepWatchdog`), the engine is dead: every open request ends at once with
`EngineDead`, every new one is refused with it, and `dead_reason` says why. The process stays
up (a stuck thread cannot be stopped): a server keeps answering 503 and its health probe,
which is what a supervisor restarts on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from specserve.clients.client import EngineClosed, EngineDead, EngineError
from specserve.clients.watchdog import StepWatchdog
from specserve.engine.engine import LLMEngine
from specserve.engine.outputs import EngineStats, RequestDelta, RequestOutput, SpeculationOverride
from specserve.sampling.params import SamplingParams

IDLE_WORK_AFTER_S = 5.0  # idle seconds before an engine's idle work runs (doubling after each)
IDLE_WORK_MAX_S = 600.0
# how long one idle-work run may go on: it stops between two timed passes after this (what it
# measured is then dropped and it runs again later); on a machine loaded by other work the
# whole of the cost model's timed passes outran the step watchdog (300 s) and killed engines
IDLE_WORK_BUDGET_S = 30.0
HOLD_AFTER = 4  # deltas a stream's reader leaves untaken before its request is held

__all__ = ["AsyncEngine", "EngineClosed", "EngineDead", "EngineError"]
log = logging.getLogger(__name__)

DeltaCallback = Callable[[RequestDelta], None]


@dataclass(frozen=True, slots=True)
class _Add:
    """A validated request posted for the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: str | None
    speculation: SpeculationOverride | None
    client: str | None = None


@dataclass(frozen=True, slots=True)
class _Hold:
    """Hold a request (its reader is behind) or release it, on the engine thread."""

    request_id: str
    held: bool


class AsyncEngine:
    """Runs an LLMEngine's steps on a background thread; add/abort from any thread or asyncio.

    E.g. `engine = LLM(...).async_engine()`, then in a coroutine
    `async for delta in engine.stream("Hello", SamplingParams(max_tokens=32)): ...`.
    While it runs an LLM's engine, that LLM's `generate`/`chat` go through it too. It
    implements `EngineClient`."""

    def __init__(self, engine: LLMEngine, step_timeout: float | None = None) -> None:
        self.engine = engine
        self._listeners: dict[str, DeltaCallback | None] = {}  # requests in flight
        self._lock = threading.Lock()  # guards _listeners
        self._inbox: deque[_Add | _Hold | str] = deque()  # adds, holds, and ids to abort
        self._wake = threading.Condition()  # work arrived / the thread went idle
        self._busy = False  # a step would do something (written by the thread)
        self._pending = False  # requests are unfinished, held ones too (written by the thread)
        self._closing = False  # no new requests
        self._stopping = False  # the thread aborts what is left and exits once idle
        self._stats = engine.stats()
        self._dead: str | None = None  # why the engine serves no more
        self._watchdog = (StepWatchdog(step_timeout, self._overran) if step_timeout is not None
                          else None)
        self._idle_after = IDLE_WORK_AFTER_S
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @staticmethod
    def from_llm(llm, step_timeout: float | None = None) -> AsyncEngine:
        """`llm.async_engine(step_timeout)` (kept for existing callers)."""
        return llm.async_engine(step_timeout)

    # ------------------------------------------------------------------ requests
    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
            speculation: SpeculationOverride | None = None,
            on_delta: DeltaCallback | None = None, text: str | None = None,
            client: str | None = None) -> str:
        """Post a request from any thread; `on_delta` is called on the engine thread with each
        of its deltas (`text`: the prompt's text to report when `prompt` is token ids;
        `client`: whom it serves, the slots are shared among clients). Invalid input raises
        ValueError naming the field, here."""
        if self.dead_reason is not None:
            raise EngineDead(f"the engine is dead: {self.dead_reason}")
        if self._closing:
            raise EngineClosed("the engine is shutting down")
        prompt_ids = self._encode(prompt)
        self.engine.check_request(prompt_ids, params, speculation)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        with self._lock:
            if request_id in self._listeners:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._listeners[request_id] = on_delta
        self._post(_Add(request_id, list(prompt_ids), params,
                        prompt if isinstance(prompt, str) else text, speculation, client))
        if self._dead is not None:  # it died while this request was being added
            self._die(self._dead)
        return request_id

    def abort(self, request_id: str) -> None:
        """Finish a request with "abort" and free its memory (any thread, any moment)."""
        self._post(request_id)

    def _post(self, item: _Add | _Hold | str) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify_all()

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
                     speculation: SpeculationOverride | None = None,
                     client: str | None = None) -> AsyncIterator[RequestDelta]:
        """Add a request and yield its deltas until it finishes; while the reader leaves
        `HOLD_AFTER` of them untaken the request is held (see the module). Validates on the
        first iteration (ValueError naming the field); leaving early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        held = False

        def arrive(delta: RequestDelta) -> None:  # on the loop
            nonlocal held
            queue.put_nowait(delta)
            if not held and not delta.finished and queue.qsize() >= HOLD_AFTER:
                held = True
                self._post(_Hold(delta.request_id, True))

        def deliver(delta: RequestDelta) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(arrive, delta)
            except RuntimeError:  # the loop is closed: nobody listens any more
                self.abort(delta.request_id)

        rid = self.add(prompt, params, request_id, speculation, on_delta=deliver, client=client)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                if held and queue.qsize() <= HOLD_AFTER // 2:
                    held = False
                    self._post(_Hold(rid, False))
                finished = delta.finished
                if isinstance(delta.error, (EngineClosed, EngineDead)):
                    raise delta.error
                if delta.error is not None:
                    raise EngineError(f"request {rid} failed in the engine: "
                                      f"{delta.error!r}") from delta.error
                yield delta
        finally:
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
            while (self._pending or self._inbox) and self._thread.is_alive() \
                    and self._dead is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wake.wait(left)
            self._stopping = True
            self._wake.notify_all()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._dead is None:
            self._thread.join()  # a stuck step's thread is left behind: it is a daemon

    # ------------------------------------------------------------------ the thread
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

    def _next_step(self) -> bool:
        """Take the inbox, run one step, hand out its deltas; False once stopped and idle."""
        if not self._await_work():
            return False
        self._watched(self._drain_inbox)
        if self._stopping:
            self.engine.abort_all()
        deltas: list[RequestDelta] = []
        if self.engine.has_unfinished():
            deltas = self._watched(self._step)
        if self._dead is not None:  # the watchdog gave up on this step while it ran
            self._let_go()
            return False
        self._stats = self.engine.stats()
        for delta in deltas:
            self._deliver(delta)
        with self._wake:
            self._busy = self.engine.has_work()
            self._pending = self.engine.has_unfinished()
            self._wake.notify_all()
        return True

    def _let_go(self) -> None:
        """A dead engine's requests (their listeners already failed) free what they hold."""
        try:
            self.engine.abort_all()
            self.engine.step()
        except Exception:  # noqa: BLE001 - the engine is dead already
            log.exception("engine step failed while letting go of a dead engine's requests")

    def _step(self) -> list[RequestDelta]:
        try:
            return self.engine.step()
        except Exception as error:  # noqa: BLE001 - the engine's own failures are in deltas
            log.exception("engine step failed outside the requests")
            return self._fail_everything(error)

    def _watched(self, work):
        """Run `work` on this thread under the watchdog."""
        if self._watchdog is not None:
            self._watchdog.started()
        try:
            return work()
        finally:
            if self._watchdog is not None:
                self._watchdog.finished()

    def _drain_inbox(self) -> None:
        """Apply the posted adds and aborts, in order (on the engine thread)."""
        with self._wake:
            items, self._inbox = list(self._inbox), deque()
            self._busy = self._busy or bool(items)
            self._pending = self._pending or bool(items)
        for item in items:
            if isinstance(item, str):
                self.engine.abort_request(item)
                continue
            if isinstance(item, _Hold):
                self.engine.hold_request(item.request_id, item.held)
                continue
            try:
                self.engine.add_request(item.prompt_ids, item.params, item.request_id,
                                        item.text, item.speculation, item.client)
            except Exception as error:  # noqa: BLE001 - handed to that request alone
                self._deliver(RequestDelta(item.request_id, [], True, None, error))

    def _await_work(self) -> bool:
        """Wait until there is work (True) or the engine stops idle (False). An engine with
        work for an idle moment (`LLMEngine.run_idle_work`) runs it once it has been idle
        `self._idle_after` seconds (times a random 1-2, so that engines started together do
        not retry together), for `IDLE_WORK_BUDGET_S` at most or until work arrives, and waits
        twice as long before trying again."""
        while True:
            with self._wake:
                since = time.monotonic()
                patience = self._idle_after * random.uniform(1.0, 2.0)
                while not (self._inbox or self._busy or self._stopping):
                    if not self.engine.has_idle_work:
                        self._wake.wait()
                        continue
                    left = patience - (time.monotonic() - since)
                    if left <= 0:
                        break
                    self._wake.wait(left)
                else:
                    return bool(self._inbox or self._busy or not self._stopping
                                or self.engine.has_unfinished())
            until = time.monotonic() + IDLE_WORK_BUDGET_S
            self._watched(lambda: self.engine.run_idle_work(
                lambda: bool(self._inbox) or time.monotonic() > until))
            self._idle_after = min(2 * self._idle_after, IDLE_WORK_MAX_S)

    def _deliver(self, delta: RequestDelta) -> None:
        with self._lock:
            callback = self._listeners.get(delta.request_id)
            if delta.finished:
                self._listeners.pop(delta.request_id, None)
        if callback is not None:
            try:
                callback(delta)
            except Exception:  # noqa: BLE001 - one listener must not stop the engine
                log.exception("delta callback for request %s failed", delta.request_id)

    def _overran(self, seconds: float) -> None:
        """The watchdog's call: a step has run `seconds`, beyond the timeout."""
        log.critical("an engine step has run for %.1f s (step timeout %.1f s): the engine is "
                     "dead", seconds, self._watchdog.timeout)
        self._die(f"an engine step ran for more than {self._watchdog.timeout:g} s")

    def _die(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._fail_listeners(EngineDead(f"the engine is dead: {self._dead}"))
        with self._wake:
            self._wake.notify_all()

    def _fail_listeners(self, error: Exception) -> None:
        with self._lock:
            orphans, self._listeners = self._listeners, {}
        for rid, callback in orphans.items():
            if callback is None:
                continue
            try:
                callback(RequestDelta(rid, [], True, None, error))
            except Exception:  # noqa: BLE001 - the others must still hear of it
                log.exception("delta callback for request %s failed", rid)

    def _fail_everything(self, error: Exception) -> list[RequestDelta]:
        """A failure the step could not pin on its requests: end every request with it."""
        rids = list(self.engine.requests)
        self.engine.abort_all()
        try:
            self.engine.step()  # let the aborted requests go (their deltas are replaced)
        except Exception:  # noqa: BLE001 - the engine is failing already
            log.exception("engine step failed while aborting after a failure")
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
