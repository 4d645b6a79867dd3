"""AsyncEngine: streams from asyncio, aborts, failures and shutdown on a tiny random model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve.clients.async_engine import AsyncEngine, EngineClosed, EngineDead, EngineError
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests import tiny

PROMPTS = ["the cat", "in the hat sat", "x", "hello there, the"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=5), tmp_path_factory.mktemp("m"))
    return load_model(path, "float32", weights="int8")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def collect(engine: AsyncEngine, prompt, params, **kw):
    deltas = [d async for d in engine.stream(prompt, params, **kw)]
    return deltas


def joined(deltas) -> tuple[str, list[int]]:
    text = "".join(c.text for d in deltas for c in d.completions)
    ids = [t for d in deltas for c in d.completions for t in c.token_ids]
    return text, ids


def test_concurrent_streams_equal_llm_generate_greedy_outputs(model):
    params = [greedy(12 + 3 * i) for i in range(len(PROMPTS))]
    expected = LLM(model).generate(PROMPTS, params)
    engine = AsyncEngine.from_llm(LLM(model, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}))

    async def main():
        return await asyncio.gather(*[collect(engine, p, sp) for p, sp in zip(PROMPTS, params)])

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown(timeout=10)
    for deltas, want in zip(results, expected):
        final = deltas[-1].output
        assert deltas[-1].finished and final.token_ids == want.token_ids
        text, ids = joined(deltas)
        assert text == final.text == want.text and ids == final.token_ids
        assert final.outputs[0].queue_time is not None


def test_leaving_a_stream_early_aborts_the_request_and_frees_it(model):
    engine = AsyncEngine.from_llm(LLM(model))

    async def main():
        seen = 0
        stream = engine.stream("the cat", greedy(500), request_id="leaver")
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        other = await collect(engine, "x", greedy(5))
        return other

    try:
        other = asyncio.run(main())
        deadline = time.monotonic() + 10
        while engine.engine.has_request("leaver") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.engine.has_request("leaver")
        stats = engine.stats()
        assert stats.aborted == 1 and stats.running == 0 and stats.kv_blocks_used == 0
        assert other[-1].output.outputs[0].finish_reason == "length"
    finally:
        engine.shutdown(timeout=10)


def test_invalid_input_raises_on_first_iteration_naming_the_field(model):
    engine = AsyncEngine.from_llm(LLM(model))

    async def main():
        with pytest.raises(ValueError, match="token ids"):
            await collect(engine, [5, 10 ** 6], greedy(4))
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, b"bytes", greedy(4))
        await collect(engine, "ok", greedy(2), request_id="dup")
        return await collect(engine, "ok", greedy(2), request_id="dup")  # finished: reusable

    try:
        assert asyncio.run(main())[-1].finished
        assert not engine.engine.has_unfinished()
    finally:
        engine.shutdown(timeout=10)


def test_a_failing_step_errors_the_streams_in_it_and_the_engine_keeps_serving(model):
    llm = LLM(model)
    engine = AsyncEngine.from_llm(llm)
    forward, calls = llm.engine.runner.forward, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded")
        return forward(*a, **kw)

    llm.engine.runner.forward = failing

    async def main():
        with pytest.raises(EngineError, match="kernel exploded"):
            await collect(engine, "the cat", greedy(10))
        return await collect(engine, "the cat", greedy(10))

    try:
        deltas = asyncio.run(main())
        assert deltas[-1].output.token_ids == LLM(model).generate("the cat", greedy(10))[0].token_ids
    finally:
        engine.shutdown(timeout=10)


def test_abort_from_another_thread_ends_the_stream_with_abort(model):
    engine = AsyncEngine.from_llm(LLM(model))

    async def main():
        got = []
        async for delta in engine.stream("the cat", greedy(400), request_id="victim"):
            got.append(delta)
            if len(got) == 2:
                threading.Thread(target=engine.abort, args=("victim",)).start()
        return got

    try:
        got = asyncio.run(main())
        final = got[-1].output.outputs[0]
        assert final.finish_reason == "abort" and len(final.token_ids) < 400
        assert joined(got) == (final.text, final.token_ids)
    finally:
        engine.shutdown(timeout=10)


def test_shutdown_aborts_what_does_not_finish_within_the_timeout(model):
    engine = AsyncEngine.from_llm(LLM(model))
    finished = []
    engine.add("the cat", greedy(1000), request_id="long", on_delta=lambda d: d.finished and finished.append(d))
    engine.add("x", greedy(1), request_id="short", on_delta=lambda d: d.finished and finished.append(d))
    deadline = time.monotonic() + 10
    while not any(d.request_id == "short" for d in finished) and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.shutdown(timeout=0.05)  # "long" (1000 tokens) is still far from done: aborted
    reasons = {d.request_id: d.output.outputs[0].finish_reason for d in finished}
    assert reasons == {"short": "length", "long": "abort"}
    assert not engine.engine.has_unfinished()
    with pytest.raises(EngineClosed):
        engine.add("x", greedy(1))


def test_stats_count_running_and_waiting(model):
    engine = AsyncEngine.from_llm(LLM(model, max_num_seqs=1))
    for i in range(3):
        engine.add("the cat", greedy(200), request_id=f"r{i}")
    deadline = time.monotonic() + 10
    while engine.stats().running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats.running == 1 and stats.waiting == 2 and 0 < stats.kv_usage <= 1
    assert stats.healthy and stats.spec.drafted == 0
    engine.shutdown(timeout=0)
    assert engine.stats().aborted == 3


def test_a_stop_string_never_shows_in_the_stream_on_a_real_tokenizer(model):
    llm = LLM(model)
    full = llm.generate("the cat", greedy(40))[0].text
    stop = full[10:13]
    expected = llm.generate("the cat", greedy(40, stop=[stop]))[0]
    engine = AsyncEngine.from_llm(llm)
    try:
        deltas = asyncio.run(collect(engine, "the cat", greedy(40, stop=[stop])))
    finally:
        engine.shutdown(timeout=10)
    shown = ""
    for d in deltas:
        for c in d.completions:
            shown += c.text
            assert expected.text.startswith(shown)
    final = deltas[-1].output
    assert shown == final.text == expected.text == full[:full.index(stop)]
    assert final.finish_reason == "stop"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_open_and_new_requests_with_engine_dead(model):
    llm = LLM(model)
    engine = AsyncEngine.from_llm(llm)
    step = llm.engine.step

    def dying_step():
        step()
        raise SystemExit  # not an Exception: the thread itself ends

    llm.engine.step = dying_step

    async def main():
        with pytest.raises(EngineDead, match="the engine thread died"):
            await collect(engine, "the cat", greedy(50))
        with pytest.raises(EngineDead):  # refused at once, not queued for a thread that is gone
            await collect(engine, "the cat", greedy(5))

    asyncio.run(main())
    engine._thread.join(timeout=10)  # it ended by itself
    assert not engine._thread.is_alive()
    assert engine.dead_reason == "the engine thread died"
    with pytest.raises(EngineDead):
        engine.generate([([1, 2, 3], greedy(3), None)])
    engine.shutdown(0)


def test_a_step_beyond_the_step_timeout_fails_every_request_while_it_hangs(model):
    llm = LLM(model)
    engine = AsyncEngine.from_llm(llm, step_timeout=0.2)
    step, release, hanging = llm.engine.step, threading.Event(), threading.Event()

    def hanging_step():
        if llm.engine.has_request("hang"):
            hanging.set()
            release.wait()
        return step()

    llm.engine.step = hanging_step

    async def main():
        other = asyncio.ensure_future(collect(engine, "in the hat", greedy(400)))
        with pytest.raises(EngineDead, match="ran for more than 0.2 s"):
            await collect(engine, "the cat", greedy(50), request_id="hang")
        with pytest.raises(EngineDead):
            await other
        assert hanging.is_set() and not release.is_set()  # failed while the step still hung
        with pytest.raises(EngineDead):
            await collect(engine, "x", greedy(2))

    try:
        asyncio.run(main())
        assert "ran for more than" in engine.dead_reason
    finally:
        release.set()
        engine.shutdown(0)
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive() and not llm.engine.has_unfinished()


def test_a_clean_shutdown_is_not_a_dead_engine(model):
    engine = AsyncEngine.from_llm(LLM(model), step_timeout=30)
    engine.shutdown(0)
    assert engine.dead_reason is None


def test_a_stream_whose_reader_stops_is_held_while_others_run_and_resumes_exactly(model):
    """Reader A takes one delta and stops: after a few more steps its request is held (the
    engine makes nothing more for it) while B runs to its end on the one slot A left; A then
    reads on and gets exactly its tokens alone."""
    from specserve.clients.async_engine import HOLD_AFTER

    expected = LLM(model).generate(PROMPTS[:2], [greedy(40), greedy(40)])
    engine = AsyncEngine.from_llm(LLM(model, max_num_seqs=1))

    async def main():
        a = engine.stream(PROMPTS[0], greedy(40))
        deltas = [await anext(a)]
        deadline = time.monotonic() + 30
        while engine.stats().held == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        held = engine.stats().held
        made = engine.engine.requests[deltas[0].request_id].seqs[0].num_output
        b = await collect(engine, PROMPTS[1], greedy(40))  # the slot is free for B
        still = engine.engine.requests[deltas[0].request_id].seqs[0].num_output
        deltas += [d async for d in a]
        return held, made, still, b, deltas

    try:
        held, made, still, b, a = asyncio.run(main())
    finally:
        engine.shutdown(timeout=10)
    assert held == 1 and made == still  # held: nothing made for A while B ran
    assert made <= 1 + HOLD_AFTER + 1  # a delta per step: the one read, the untaken, one more
    assert a[-1].output.token_ids == expected[0].token_ids
    assert b[-1].output.token_ids == expected[1].token_ids and engine.stats().held == 0
