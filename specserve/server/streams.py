"""Driving engine streams from request handlers: one stream per prompt, merged (at most a few
prompts in the engine at once); a request whose client goes away, or whose deadline passes,
is aborted (its memory freed) instead of running on."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request

from specserve.clients.client import EngineClient
from specserve.engine.outputs import RequestDelta
from specserve.server.preparation import Job

T = TypeVar("T")


async def engine_stream(engine: EngineClient, job: Job, request_id: str) -> AsyncIterator[RequestDelta]:
    """The engine's deltas for one job. Leaving early (an error, a cancelled task, a closed
    generator) aborts the request."""
    finished = False
    stream = engine.stream(job.prompt_ids, job.params, request_id=request_id,
                           speculation=job.speculation)
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


async def merged(engine: EngineClient, jobs: list[Job], request_id: str,
                 concurrency: int | None = None) -> AsyncIterator[tuple[int, RequestDelta]]:
    """`(job index, delta)` from all jobs' streams as they come (one job: no tasks needed),
    with at most `concurrency` jobs in the engine at once (None: all)."""
    if len(jobs) == 1:
        async for delta in engine_stream(engine, jobs[0], request_id):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    turns = asyncio.Semaphore(concurrency or len(jobs))

    async def pump(i: int, job: Job) -> None:
        try:
            async with turns:
                async for delta in engine_stream(engine, job, f"{request_id}-{i}"):
                    await queue.put((i, delta))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

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
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
