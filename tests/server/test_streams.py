"""`streams`: a job's n split into engine requests of at most a share of the slots (each
completion seeded as in one request, the output joined as one request's), and
`ahead_of_client` reading a stream a bounded number of items ahead of its reader, and the
grammar a job was prepared with serving all its engine requests."""

from __future__ import annotations

import asyncio
import gc
import re

import pytest

from specserve.engine.outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput
from specserve.sampling.params import SamplingParams
from specserve.server.preparation import Job
from specserve.server.streams import READ_AHEAD, ahead_of_client, job_stream, parts


def job(n: int, seed: int | None = 5) -> Job:
    return Job([1, 2, 3], SamplingParams(n=n, seed=seed), None)


def test_n_beyond_the_share_runs_in_parts_each_completion_seeded_as_in_one_request():
    runs = parts(job(10), share=4)
    assert [(first, p.params.n, p.params.seed) for first, p in runs] == [
        (0, 4, 5), (4, 4, 9), (8, 2, 13)]  # completion i: seed 5 + i either way
    assert parts(job(4), share=4) == [(0, job(4))] and parts(job(9), None) == [(0, job(9))]
    assert [p.params.seed for _, p in parts(job(3, seed=None), share=1)] == [None] * 3


class Engine:
    """Answers each request with one delta per completion, then a finishing one."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []

    async def stream(self, prompt, params, request_id, speculation=None, client=None):
        self.requests.append((request_id, params.n))
        outputs = [CompletionOutput(i, f"s{params.seed + i}", [i], "length", 1, None, None, None)
                   for i in range(params.n)]
        yield RequestDelta(request_id, [CompletionDelta(i, [i], "x", None, [], None)
                                        for i in range(params.n)], False, None)
        yield RequestDelta(request_id, [], True, RequestOutput(request_id, None, prompt, outputs,
                                                               True))

    def abort(self, request_id) -> None:
        raise AssertionError("nothing is aborted")


def test_the_parts_stream_as_one_request_and_join_into_its_output():
    engine = Engine()

    async def collect():
        return [d async for d in job_stream(engine, job(5), "req", share=2)]

    deltas = asyncio.run(collect())
    assert engine.requests == [("req.0", 2), ("req.1", 2), ("req.2", 1)]
    assert [d.finished for d in deltas] == [False] * 5 + [True]
    assert sorted(c.index for d in deltas for c in d.completions) == [0, 1, 2, 3, 4]
    out = deltas[-1].output
    assert (out.request_id, out.prompt_token_ids) == ("req", [1, 2, 3])  # the prompt once
    assert [(c.index, c.text) for c in out.outputs] == [(i, f"s{5 + i}") for i in range(5)]


def test_ahead_of_client_reads_a_few_items_ahead_of_its_reader_and_closing_stops_it():
    """The next items are ready when the reader comes back, but a reader that stops stops the
    source after `READ_AHEAD` more (so the engine behind it is held, not run to the end)."""
    ended = asyncio.Event()
    pulled: list[int] = []

    async def items(count: int):
        try:
            for i in range(count):
                await asyncio.sleep(0)
                pulled.append(i)
                yield i
        finally:
            ended.set()

    async def scenario():
        ahead = ahead_of_client(items(100))
        first = await anext(ahead)  # one item read, then the reader stalls
        await asyncio.sleep(0.2)
        stalled_at = len(pulled)
        rest = [i async for i in ahead]
        ended.clear()
        endless = ahead_of_client(items(10**9))
        await anext(endless)
        await endless.aclose()  # the client went away: the source is closed
        return first, stalled_at, rest, ended.is_set()

    first, stalled_at, rest, closed = asyncio.run(scenario())
    assert first == 0 and stalled_at == 1 + READ_AHEAD  # the one read, and the few ahead
    assert rest == list(range(1, 100)) and closed


def test_a_reader_cancelled_mid_stream_closes_the_source_at_once():
    """The response task is cancelled while it waits on its client (gone): the source is
    closed (its engine requests aborted) at once, not when the abandoned generator is
    collected (it stays referenced here, as a traceback would keep it)."""
    ended = asyncio.Event()

    async def items():
        try:
            while True:
                await asyncio.sleep(0)
                yield 1
        finally:
            ended.set()

    async def scenario():
        ahead = ahead_of_client(items())

        async def respond():
            async for _ in ahead:
                await asyncio.sleep(10)  # a send waiting on a client that reads nothing

        task = asyncio.create_task(respond())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait_for(ended.wait(), 2)
        return ahead

    assert asyncio.run(scenario()) is not None


@pytest.mark.parametrize("held", [True, False])
def test_the_grammar_a_job_was_prepared_with_serves_every_share_never_compiled_again(held):
    """A job of n = 4 on a share of 2 runs as two engine requests, one after the other, after
    the compile cache has let its grammar go (as many other specs compiled since): the job's
    grammar is found for both, nothing is compiled on the loop or the engine thread. The
    can-fail twin: a job that holds no grammar has it compiled again."""
    from specserve.clients.async_engine import AsyncEngine
    from specserve.sampling.structured import StructuredOutputsParams
    from tests import toy
    from tests.engine.test_grammar_decoding import EOS, REGEX, V, grammar_engine

    engine = grammar_engine(toy.random_table(V, seed=3), None, 2, "suffix")
    compiler = engine.grammars
    spec = StructuredOutputsParams(regex=REGEX)
    grammar = compiler.compile(spec) if held else None
    prepared = Job([EOS, 0, 1], SamplingParams(n=4, seed=1, max_tokens=6,
                                               structured_outputs=spec), None, grammar=grammar)
    for i in range(compiler.cache_size):
        compiler.compile(StructuredOutputsParams(regex=f"a{{{i + 1}}}"))
    before = compiler.compiled
    gc.collect()
    async_engine = AsyncEngine(engine)

    async def run():
        return [d async for d in job_stream(async_engine, prepared, "req", share=2)]

    try:
        deltas = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert len(deltas[-1].output.outputs) == 4
    assert all(re.fullmatch(REGEX, c.text) for c in deltas[-1].output.outputs)
    assert (compiler.compiled - before == 0) == held


def test_a_quiet_stretch_yields_heartbeats_then_the_items_and_closing_closes_the_source():
    """Timers fire in order: the 0.02-s heartbeat wait always ends before the 0.3-s item."""
    from specserve.server.streams import HEARTBEAT, with_heartbeats

    closed = []

    async def slow():
        try:
            await asyncio.sleep(0.3)
            yield "first"
            yield "second"
            await asyncio.sleep(3600)
            yield "never"
        finally:
            closed.append(True)

    async def run():
        got = []
        stream = with_heartbeats(slow(), 0.02)
        async for item in stream:
            got.append(item)
            if item == "second":
                break
        await stream.aclose()
        return got

    got = asyncio.run(run())
    assert got[0] is HEARTBEAT and got[-2:] == ["first", "second"]
    assert all(g is HEARTBEAT for g in got[:-2]) and closed == [True]
