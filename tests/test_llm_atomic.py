"""`LLM.generate` is all or nothing: a failure or an interrupt inside a call aborts exactly that
call's requests and leaves the object ready; concurrent calls never cross-deliver."""

from __future__ import annotations

import threading

import pytest

from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests import tiny

PROMPTS = [[5, 17, 33, 8], [90, 41, 7], [12, 12, 60, 3, 9]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=3), tmp_path_factory.mktemp("m"))
    return LLM(load_model(path, "float32"), speculative_config={"method": "ngram",
                                                               "num_speculative_tokens": 2})


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [out.token_ids for out in llm.generate(PROMPTS, greedy())]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and engine.request_ids() == []
    assert not engine.scheduler.running and not engine.scheduler.waiting


def hook_forward(llm: LLM, fail_on_call: int, error: BaseException):
    """Make the target's `fail_on_call`-th pass raise `error`; returns a function undoing it."""
    runner = llm.engine.runner
    forward, calls = runner.forward, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == fail_on_call:
            raise error
        return forward(*a, **kw)

    runner.forward = failing
    return lambda: setattr(runner, "forward", forward)


def test_a_bad_prompt_among_three_queues_nothing_and_the_next_call_works(llm, reference):
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate(PROMPTS[:2] + [[5, 10 ** 6]], greedy())
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference


def test_an_exception_inside_a_step_aborts_the_call_and_the_next_call_works(llm, reference):
    undo = hook_forward(llm, 3, RuntimeError("boom"))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            llm.generate(PROMPTS, greedy())
    finally:
        undo()
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference


def test_keyboard_interrupt_inside_generate_aborts_that_calls_requests_only(llm, reference):
    undo = hook_forward(llm, 4, KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, greedy())
    finally:
        undo()
    assert_idle(llm)
    assert llm.engine.num_aborted >= 3
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference


def test_requests_queued_by_others_are_not_taken_by_a_failing_call(llm, reference):
    """An interrupted call aborts its own requests, not one queued on the engine directly."""
    other = llm.engine.add_request(PROMPTS[0], greedy(), request_id="someone-else")
    undo = hook_forward(llm, 2, KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[1:], greedy())
    finally:
        undo()
    assert llm.engine.has_request(other)
    finals = {}
    while llm.engine.has_unfinished():
        finals.update({d.request_id: d.output for d in llm.engine.step() if d.finished})
    # it was in the interrupted pass (so it fails with it) or it runs on to the end
    assert finals[other].outputs[0].finish_reason in ("length", "abort")
    assert_idle(llm)


def test_two_threads_times_several_calls_each_get_their_own_results(llm, reference):
    results: dict[tuple[int, int], list[list[int]]] = {}
    errors = []

    def worker(t: int) -> None:
        try:
            for call in range(3):
                order = PROMPTS[t:] + PROMPTS[:t]  # each thread asks in its own order
                outs = llm.generate(order, greedy())
                results[t, call] = [o.token_ids for o in outs]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for (t, _), tokens in results.items():
        assert tokens == reference[t:] + reference[:t]
    assert len(results) == 6
    assert_idle(llm)


def test_calls_run_concurrently_through_an_async_engine_and_serially_again_after_it(llm, reference):
    from specserve.clients.async_engine import AsyncEngine

    engine = AsyncEngine.from_llm(llm)
    try:
        with pytest.raises(RuntimeError, match="already runs"):
            AsyncEngine.from_llm(llm)
        results, errors = {}, []

        def worker(t: int) -> None:
            try:
                for call in range(2):
                    outs = llm.generate(PROMPTS[t:] + PROMPTS[:t], greedy())
                    results[t, call] = [o.token_ids for o in outs]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors and len(results) == 6
        for (t, _), tokens in results.items():
            assert tokens == reference[t:] + reference[:t]
        undo = hook_forward(llm, 2, RuntimeError("boom"))
        try:
            with pytest.raises(RuntimeError, match="boom"):
                llm.generate(PROMPTS, greedy())
        finally:
            undo()
        with pytest.raises(ValueError, match=r"prompts\[1\]"):
            llm.generate([PROMPTS[0], [10 ** 6]], greedy())
    finally:
        engine.shutdown(timeout=10)
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference
