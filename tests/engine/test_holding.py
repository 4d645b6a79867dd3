"""Slots for the readers who read and for every client: a held request (its reader is behind)
is not scheduled and leaves its slot to a waiting one, is the first preempted when blocks run
out, and resumes with exactly the tokens it gives alone; one client's burst leaves slots to
another client that arrives later (its newest sequence preempted for it), and the tokens stay
those each request gives alone. Tiny random model, greedy, int8 weights."""

from __future__ import annotations

import pytest

from specserve.llm import LLM
from specserve.sampling.params import SamplingParams
from specserve.weights.loader import load_model
from tests import tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=3), tmp_path_factory.mktemp("m"))
    return load_model(path, "float32", weights="int8")


PROMPTS = [[5 + i, 17, 3 + 2 * i, 40, 9] for i in range(10)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def alone(model, prompt: list[int], n: int) -> list[int]:
    return LLM(model).generate([prompt], greedy(n))[0].outputs[0].token_ids


class Driver:
    """Steps an engine, recording each request's output length after every step."""

    def __init__(self, engine) -> None:
        self.engine, self.step_no = engine, 0
        self.lengths: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def add(self, prompt: list[int], n: int, client: str | None = None) -> str:
        rid = self.engine.add_request(prompt, greedy(n), client=client)
        self.lengths[rid] = []
        return rid

    def step(self) -> None:
        for delta in self.engine.step():
            if delta.finished:
                self.tokens[delta.request_id] = delta.output.outputs[0].token_ids
        for rid in self.lengths:
            req = self.engine.requests.get(rid)
            done = rid in self.tokens
            self.lengths[rid].append(len(self.tokens[rid]) if done else
                                     req.seqs[0].num_output if req is not None else 0)
        self.step_no += 1

    def run(self) -> None:
        while self.engine.has_unfinished():
            self.step()

    def first_token_step(self, rid: str) -> int:
        return next(i for i, n in enumerate(self.lengths[rid]) if n > 0)


def test_a_held_request_leaves_its_slot_to_a_waiting_one_and_resumes_exactly(model):
    engine = LLM(model, max_num_seqs=2).engine
    d = Driver(engine)
    a, b, c = (d.add(PROMPTS[i], 24) for i in range(3))
    for _ in range(3):
        d.step()
    assert d.lengths[c][-1] == 0 and d.lengths[a][-1] > 0  # two slots: c waits
    engine.hold_request(a)
    assert engine.stats().held == 1
    for _ in range(4):
        d.step()
    held_at = d.lengths[a][-1]
    assert d.lengths[a][-4:] == [held_at] * 4  # not scheduled while held
    assert d.lengths[c][-1] > 0  # its slot went to the waiting request
    engine.hold_request(a, held=False)
    d.run()
    assert engine.stats().held == 0 and engine.stats().kv_blocks_used == 0
    for rid, i in ((a, 0), (b, 1), (c, 2)):
        assert d.tokens[rid] == alone(model, PROMPTS[i], 24)


def test_an_engine_whose_requests_are_all_held_has_no_work_until_one_is_released(model):
    engine = LLM(model).engine
    rid = engine.add_request(PROMPTS[0], greedy(8))
    engine.step()
    engine.hold_request(rid)
    engine.step()  # hands out what the last step made
    assert engine.has_unfinished() and not engine.has_work()
    engine.hold_request(rid, held=False)
    assert engine.has_work()


def test_held_sequences_are_preempted_first_when_blocks_run_out(model):
    """A cache of 12 blocks of 16: four sequences growing to 60 positions cannot all stay;
    with the oldest held, it is the one preempted, not the newest running one."""
    per_token = model.model.kv_bytes_per_token(model.model.kv_cache_dtype())
    engine = LLM(model, max_num_seqs=4, max_model_len=64,
                 kv_cache_memory=12 * 16 * per_token).engine
    assert engine.stats().kv_blocks_total == 12
    d = Driver(engine)
    rids = [d.add(PROMPTS[i], 50) for i in range(4)]
    d.step()
    d.step()
    engine.hold_request(rids[0])
    preempted = []
    while engine.scheduler.num_preemptions == 0 and engine.has_unfinished():
        before = {s.request_id: s.status for s in engine.scheduler.running}
        d.step()
        preempted = [r for r, status in before.items()
                     if engine.requests[r].seqs[0] not in engine.scheduler.running]
    assert preempted == [rids[0]]
    engine.hold_request(rids[0], held=False)
    d.run()
    for i, rid in enumerate(rids):
        assert d.tokens[rid] == alone(model, PROMPTS[i], 50)


@pytest.mark.parametrize("other_client", ["b", "a"])
def test_one_clients_burst_leaves_slots_to_a_client_that_comes_later(model, other_client):
    """Client a sends 8 requests at once on 4 slots; client b sends one a few steps later and
    gets a slot at once (a's newest preempted for it). The can-fail twin: sent as client a,
    the same request waits behind a's burst."""
    engine = LLM(model, max_num_seqs=4).engine
    d = Driver(engine)
    burst = [d.add(PROMPTS[i], 30, client="a") for i in range(8)]
    for _ in range(3):
        d.step()
    late = d.add(PROMPTS[8], 30, client=other_client)
    arrived = d.step_no
    d.run()
    waited = d.first_token_step(late) - arrived
    if other_client == "b":
        assert waited <= 2
    else:
        assert waited >= 20  # behind four of a's requests that each run 30 steps or more
    for i, rid in enumerate(burst + [late]):
        assert d.tokens[rid] == alone(model, PROMPTS[i], 30)
