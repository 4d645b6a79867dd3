"""Driving engine streams from request handlers: one stream per prompt, merged (at most a
share of the engine's sequence slots in use at once), a prompt's `n` completions split into
engine requests of at most that share; a request whose client goes away, or whose deadline
passes, is aborted (its memory freed) instead of running on.

Paced by the reader: nothing here reads ahead of its consumer by more than a few items
(`ahead_of_client`: `READ_AHEAD`; `merged`: one delta per job), so when an HTTP client stops
reading (the server's `send` waits while it has more than `max_unread_bytes` unread, see
`guard.py`), the engine stream behind it stops being read too, and the engine holds its
request (`AsyncEngine.stream`): its slot goes to others until the client reads again, or the
write timeout drops it. Every route that streams through `ahead_of_client` and `merged` (or
`engine_stream`) is paced alike.

`CLIENT` names whom the request being served is for (set per HTTP request by the guard, from
the client's address): each engine request carries it, and the engine shares its sequence
slots among clients, so that one client's burst cannot hold every slot.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from dataclasses import replace
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request

from specserve.clients.client import EngineClient
from specserve.engine.outputs import RequestDelta, RequestOutput
from specserve.server.preparation import Job

T = TypeVar("T")
READ_AHEAD = 4  # items `ahead_of_client` takes from its source before its reader takes them
CLIENT: ContextVar[str | None] = ContextVar("specserve_client", default=None)


async def engine_stream(engine: EngineClient, job: Job, request_id: str) -> AsyncIterator[RequestDelta]:
    """The engine's deltas for one job. Leaving early (an error, a cancelled task, a closed
    generator) aborts the request."""
    finished = False
    stream = engine.stream(job.prompt_ids, job.params, request_id=request_id,
                           speculation=job.speculation, client=CLIENT.get())
    try:
        async for delta in stream:
            finished = finished or delta.finished
            yield delta
            if finished:
                break
    finally:
        if not finished:
            engine.abort(request_id)
        await stream.aclose()


def parts(job: Job, share: int | None) -> list[tuple[int, Job]]:
    """`(first completion index, job)` of each engine request that runs `job`: itself when its
    n fits `share` (None: any n does), else consecutive runs of at most `share` completions,
    the run from completion i seeded `seed + i`, so each completion gets the seed it has in
    one request (the engine seeds completion i with `seed + i`)."""
    n = job.params.n
    if share is None or n <= share:
        return [(0, job)]
    seed = job.params.seed
    return [(first, replace(job, params=replace(
        job.params, n=min(share, n - first), seed=None if seed is None else seed + first)))
        for first in range(0, n, share)]


async def job_stream(engine: EngineClient, job: Job, request_id: str,
                     share: int | None) -> AsyncIterator[RequestDelta]:
    """The deltas of `job` as one engine request's, however many it runs as (`parts`, one
    after another): completion indices counted over the whole job, `finished` and the whole
    output on the last part's last delta."""
    runs = parts(job, share)
    if len(runs) == 1:
        async for delta in engine_stream(engine, job, request_id):
            yield delta
        return
    done: list[tuple[int, RequestOutput]] = []
    for k, (first, part) in enumerate(runs):
        async for delta in engine_stream(engine, part, f"{request_id}.{k}"):
            if delta.finished:
                done.append((first, delta.output))
            last = delta.finished and k == len(runs) - 1
            yield RequestDelta(request_id, [replace(c, index=c.index + first)
                                            for c in delta.completions],
                               last, joined(request_id, done) if last else None, delta.error)


def joined(request_id: str, done: list[tuple[int, RequestOutput]]) -> RequestOutput:
    """One request's output from those of its parts (`(first completion index, output)`)."""
    head = done[0][1]
    return RequestOutput(request_id, head.prompt, head.prompt_token_ids,
                         [replace(c, index=c.index + first) for first, out in done
                          for c in out.outputs], True, head.queue_time,
                         min(out.num_cached_tokens for _, out in done))


async def merged(engine: EngineClient, jobs: list[Job], request_id: str,
                 share: int | None = None) -> AsyncIterator[tuple[int, RequestDelta]]:
    """`(job index, delta)` from all jobs' streams as they come (one job: no tasks needed),
    with at most `share` sequences in the engine at once (None: all): a job's n runs in parts
    of at most `share`, and as many jobs at once as their parts fit in it."""
    if len(jobs) == 1:
        async for delta in job_stream(engine, jobs[0], request_id, share):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    width = min(jobs[0].params.n, share) if share is not None else None
    turns = asyncio.Semaphore(max(1, share // width) if width else len(jobs))
    room = asyncio.Semaphore(len(jobs))  # deltas in the queue: a job waits for its reader

    async def pump(i: int, job: Job) -> None:
        try:
            async with turns:
                async for delta in job_stream(engine, job, f"{request_id}-{i}", share):
                    await room.acquire()
                    queue.put_nowait((i, delta))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                room.release()
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def ahead_of_client(items: AsyncIterator[T], read_ahead: int = READ_AHEAD
                          ) -> AsyncIterator[T]:
    """`items`, read by a task of their own at most `read_ahead` items ahead of this
    generator's reader: the next item is ready when the client takes it, and a client that
    stops reading stops `items` after a few more (the engine then holds its request, see the
    module). Closing this generator, or the end of the task that reads it (the response's,
    cancelled when the client went away or was dropped: an abandoned generator would be
    closed only when it is collected), cancels the task, which closes `items` (aborting its
    engine requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(read_ahead)
    end = object()

    async def pump() -> None:
        try:
            while True:
                await room.acquire()
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    break
                queue.put_nowait(item)
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait(e)
        finally:
            await items.aclose()
            queue.put_nowait(end)

    task = asyncio.create_task(pump())
    reader = asyncio.current_task()
    if reader is not None:
        reader.add_done_callback(lambda _: task.cancel())
    try:
        while (item := await queue.get()) is not end:
            if isinstance(item, Exception):
                raise item
            room.release()
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(deadline: float | None, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items` until the event loop's clock passes `deadline` (None: no deadline), then
    TimeoutError; `items` is closed either way (which aborts its engine requests)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise TimeoutError
            try:
                item = await asyncio.wait_for(anext(items), left)
            except StopAsyncIteration:
                return
            yield item
    finally:
        await items.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client disconnects first; then cancel it (which aborts its
    engine requests). Returns (completed, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False, None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


HEARTBEAT = object()  # what `with_heartbeats` yields for a quiet stretch


async def with_heartbeats(items: AsyncIterator[T], every: float) -> AsyncIterator[T]:
    """`items`, and `HEARTBEAT` whenever `every` seconds pass without one (a long prefill: a
    stream can say it is alive before its first token, so that clients with an idle timeout
    wait). `items` is closed either way."""
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield HEARTBEAT
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await items.aclose()
