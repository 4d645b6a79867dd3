"""Edge cases of a speculative round: stops inside accepted runs, limits mid-draft."""

from __future__ import annotations

import torch

from specserve.sampling.params import SamplingParams
from tests import toy

V = 8


def chain_table() -> torch.Tensor:
    """Token i is almost surely followed by i + 1 (mod V)."""
    table = torch.full((V, V), 1e-3)
    for i in range(V):
        table[i, (i + 1) % V] = 1.0
    return table


def run(k, params, eos=None, bonus=True, prompt=(0,)):
    engine = toy.toy_engine(chain_table(), chain_table(), k, eos=eos, bonus=bonus)
    engine.add_request(list(prompt), params)
    (out,) = toy.run_all(engine)
    return out.outputs[0]


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def test_eos_inside_an_accepted_run_ends_the_sequence_there():
    out = run(4, greedy(max_tokens=20), eos=3)
    assert out.token_ids == [1, 2, 3]
    assert out.finish_reason == "stop"
    assert out.text == "bc"  # EOS is not text


def test_ignore_eos_runs_through_eos():
    out = run(4, greedy(max_tokens=6, ignore_eos=True), eos=3)
    assert out.token_ids == [1, 2, 3, 4, 5, 6]
    assert out.finish_reason == "length"


def test_stop_string_completed_inside_accepted_tokens():
    out = run(4, greedy(max_tokens=20, stop=["de"]))
    assert out.text == "bc"
    assert out.finish_reason == "stop"
    out = run(4, greedy(max_tokens=20, stop=["de"], include_stop_str_in_output=True))
    assert out.text == "bcde"


def test_stop_token_id_inside_accepted_run():
    out = run(4, greedy(max_tokens=20, stop_token_ids=[5]))
    assert out.token_ids == [1, 2, 3, 4, 5]
    assert out.finish_reason == "stop"


def test_max_tokens_reached_mid_draft_and_k_clipped_to_tokens_left():
    for max_tokens in range(1, 9):
        out = run(6, greedy(max_tokens=max_tokens))
        assert out.token_ids == [(i + 1) % V for i in range(max_tokens)]
        assert out.finish_reason == "length"
        assert out.spec.drafted <= max_tokens - 1  # never drafts past what can be kept
        assert out.spec.accepted == out.spec.drafted


def test_k_larger_than_tokens_left_without_bonus():
    out = run(8, greedy(max_tokens=5), bonus=False)
    assert out.token_ids == [1, 2, 3, 4, 5]
    assert out.spec.rounds == 1  # 1 from prefill + 4 accepted drafts, no bonus


def test_prompt_at_the_context_limit_is_refused_and_near_it_stops_with_length():
    import pytest

    engine = toy.toy_engine(chain_table(), chain_table(), 4, max_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([0] * 16, greedy(max_tokens=4))
    engine.add_request([0] * 13, greedy(max_tokens=10))
    (out,) = toy.run_all(engine)
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


def test_many_requests_join_and_leave_between_steps():
    engine = toy.toy_engine(chain_table(), chain_table(), 3, max_num_seqs=2)
    for i, n in enumerate([3, 9, 5, 1, 7]):
        engine.add_request([i % V], greedy(max_tokens=n), request_id=f"r{i}")
    outs = {o.request_id: o.outputs[0] for o in toy.run_all(engine)}
    for i, n in enumerate([3, 9, 5, 1, 7]):
        assert outs[f"r{i}"].token_ids == [(i % V + j + 1) % V for j in range(n)]


def test_cost_model_skips_draft_timings_of_rounds_that_resume_after_idle_rounds():
    """A round that drafts right after rounds at k = 0 first catches the draft up, so its draft
    time is not a sample of what drafting k tokens costs; every round's rest is learned."""
    from collections import Counter

    P, Q = toy.random_table(5, seed=1), toy.random_table(5, seed=2)
    from specserve.speculative.cost_model import CostModel

    engine = toy.toy_engine(P, Q, k=2)
    draft_samples, verify_samples = [], []

    class Recording(CostModel):
        def observe_draft(self, steps, seconds):
            draft_samples.append(steps)

        def observe_verify(self, k, seconds):
            verify_samples.append((k, seconds))

    engine.spec.cost = Recording()

    class Script:  # 0, 0, 2, 2, 0, 2, 2, ...
        histogram = Counter()

        def __init__(self):
            self.ks = iter([0, 0, 2, 2, 0, 2, 2, 0, 2, 2] * 10)

        def choose_k(self, room):
            return min(next(self.ks), room)

        def observe(self, proposed, accepted):
            pass

        def worth_starting(self, tokens_left, startup_s):
            return True

    engine.add_request([0, 1], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=0))
    engine.spec.state(engine.scheduler.waiting[0]).policy = Script()
    toy.run_all(engine)
    ks = [k for k, _ in verify_samples]
    assert ks[:7] == [0, 0, 2, 2, 0, 2, 2]
    resumed = sum(1 for prev, k in zip([0] + ks, ks) if k > 0 and prev == 0)
    assert len(draft_samples) == sum(1 for k in ks if k > 0) - resumed > 0
    assert all(s > 0 for _, s in verify_samples)


def test_drafts_take_a_bounded_share_of_the_steps_in_which_a_prompt_prefills():
    """Verify rows take token budget from prefill chunks: while a prompt waits or prefills,
    a step's drafts are bounded by 1/PREFILL_DRAFT_SHARE of max_num_batched_tokens (here 2
    rows), so a burst of long drafts cannot hold back a new request's first token; once
    nothing prefills, the drafts are unbounded again. Outputs stay target-only's."""
    from specserve.engine.engine import PREFILL_DRAFT_SHARE

    budget = 2 * PREFILL_DRAFT_SHARE
    engine = toy.toy_engine(chain_table(), None, -1, method="suffix", max_len=512,
                            max_num_batched_tokens=budget)
    plans = []
    plan = engine.spec.plan

    def watched(seqs, max_rows=None):
        ks = plan(seqs, max_rows)
        plans.append((engine.scheduler.has_prefill_work(), max_rows, sum(ks.values())))
        return ks

    engine.spec.plan = watched
    cycle = [i % V for i in range(48)]  # text that repeats itself: long, trusted matches
    engine.add_request(cycle, greedy(max_tokens=120), request_id="first")
    for _ in range(6):
        engine.step()
    engine.add_request(cycle[:40] * 8, greedy(max_tokens=4), request_id="second")  # 320 tokens
    outs = {o.request_id: o.outputs[0] for o in toy.run_all(engine)}
    during = [(limit, rows) for busy, limit, rows in plans if busy]
    after = [(limit, rows) for busy, limit, rows in plans if not busy]
    assert during and all(limit == 2 and rows <= 2 for limit, rows in during)
    assert any(rows == 2 for _, rows in during)  # it still drafts, within the bound
    assert all(limit is None for limit, _ in after) and max(rows for _, rows in after) > 2
    assert outs["first"].token_ids == [(48 + j) % V for j in range(120)]
