"""Greedy speculative decoding equals target-only decoding token for token.

The int8_pair run on the native 8-bit kernels, whose matmuls give each row the same bits however
many rows a pass has; with attention computed position by position, a verify pass reproduces
plain decoding's logits exactly, so even the near-ties of a random tiny model cannot split the
two. (Float32 GEMMs round differently for 1 and k + 1 rows.) Prompt rows take the prefill path
the engine chose for the model ("auto" times it: oneDNN on a machine where it is faster), the
draft model's as the target's, so an identical draft holds the target's keys on either path."""

from __future__ import annotations

import math
import threading
import time

import pytest

from specserve.llm import LLM
from specserve.speculative import calibration
from specserve.speculative.calibration import calibrate
from specserve.sampling.params import SamplingParams
from specserve.speculative.cost_model import non_decreasing
from tests import tiny

PROMPT = [5, 17, 33, 8, 90, 41]


spec = tiny.draft_spec


greedy = tiny.greedy


@pytest.mark.parametrize("k,path", [(1, "auto"), (3, "auto"), (4, "auto"), (3, "onednn"),
                                    (4, "native")])
def test_identical_draft_accepts_everything_and_matches_target(int8_pair, k, path):
    target, _ = int8_pair
    n = 40
    plain = LLM(target, prefill_path=path).generate(PROMPT, greedy(n))[0].outputs[0]
    fast = LLM(target, draft=target, speculative_config=spec(k),
               prefill_path=path).generate(PROMPT, greedy(n))[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    assert fast.spec.accepted == fast.spec.drafted
    # the prefill emits the first token; each round then emits k + 1
    assert fast.spec.rounds == math.ceil((n - 1) / (k + 1))


def test_unrelated_draft_matches_target_and_is_mostly_rejected(int8_pair):
    target, draft = int8_pair
    n = 40
    plain = LLM(target).generate(PROMPT, greedy(n))[0].outputs[0]
    fast = LLM(target, draft=draft, speculative_config=spec(4)).generate(PROMPT, greedy(n))[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    assert fast.spec.acceptance_rate < 0.3


def test_without_bonus_token_256_tokens_at_k4_take_64_rounds(int8_pair):
    target, _ = int8_pair
    llm = LLM(target, draft=target, speculative_config=spec(4, bonus_token=False), max_model_len=512)
    out = llm.generate(PROMPT, greedy(256))[0].outputs[0]
    plain = LLM(target, max_model_len=512).generate(PROMPT, greedy(256))[0].outputs[0]
    assert out.token_ids == plain.token_ids
    assert out.num_output_tokens == 256
    assert out.spec.rounds == 64


def test_tv_budget_one_accepts_every_draft_token(int8_pair):
    target, draft = int8_pair
    llm = LLM(target, draft=draft, speculative_config=spec(4, tv_budget=1.0))
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=30, seed=0, ignore_eos=True))[0].outputs[0]
    assert out.spec.drafted > 0 and out.spec.accepted == out.spec.drafted


def test_per_request_tv_budget_overrides_engine(int8_pair):
    target, draft = int8_pair
    llm = LLM(target, draft=draft, speculative_config=spec(4, tv_budget=0.0))
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=30, seed=0, ignore_eos=True,
                                              tv_budget=1.0))[0].outputs[0]
    assert out.spec.accepted == out.spec.drafted


def test_seeded_speculative_sampling_is_reproducible(int8_pair):
    target, draft = int8_pair
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=11, ignore_eos=True)
    runs = [LLM(target, draft=draft, speculative_config=spec(3)).generate(PROMPT, params)[0].token_ids
            for _ in range(2)]
    other = LLM(target, draft=draft, speculative_config=spec(3)).generate(
        PROMPT, SamplingParams(temperature=0.8, max_tokens=30, seed=12, ignore_eos=True))[0].token_ids
    assert runs[0] == runs[1]
    assert other != runs[0]


def test_mismatched_vocabulary_is_refused(int8_pair, tmp_path):
    target, _ = int8_pair
    other = tiny.build_hf_model("qwen2", seed=2)
    path = tiny.save_hf_dir(other, tmp_path / "d")
    (path / "tokenizer.json").write_text((path / "tokenizer.json").read_text().replace('"a"', '"@@"', 1))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, speculative_config=spec(2) | {"model": str(path)}, dtype="float32")


def test_padded_vocabulary_of_same_tokenizer_is_accepted(int8_pair, tmp_path):
    target, _ = int8_pair
    padded = tiny.build_hf_model("qwen2", seed=0, vocab=tiny.VOCAB + 16)
    path = tiny.save_hf_dir(padded, tmp_path / "p")
    llm = LLM(target, speculative_config=spec(2) | {"model": str(path)}, dtype="float32")
    out = llm.generate(PROMPT, greedy(12))[0].outputs[0]
    plain = LLM(target).generate(PROMPT, greedy(12))[0].outputs[0]
    assert out.token_ids == plain.token_ids


def test_ngram_greedy_equals_target_only(int8_pair):
    target, _ = int8_pair
    prompt = PROMPT * 4  # repeated text gives prompt lookup something to find
    plain = LLM(target).generate(prompt, greedy(40))[0].outputs[0]
    fast = LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).generate(
        prompt, greedy(40))[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    assert fast.spec.drafted > 0


def test_cost_aware_greedy_equals_target_only(int8_pair):
    target, draft = int8_pair
    plain = LLM(target).generate(PROMPT, greedy(40))[0].outputs[0]
    fast = LLM(target, draft=draft, speculative_config=spec(-1)).generate(PROMPT, greedy(40))[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    assert sum(fast.spec.k_histogram.values()) == fast.spec.rounds


class Scripted:
    """A draft-length policy that replays a list of k (cycling), like cost_aware's idle
    stretches and probes."""

    def __init__(self, ks):
        self.ks, self.i = list(ks), 0
        from collections import Counter
        self.histogram = Counter()

    def choose_k(self, max_k):
        k = min(self.ks[self.i % len(self.ks)], max_k)
        self.i += 1
        self.histogram[k] += 1
        return k

    def observe(self, proposed, accepted):
        pass

    def worth_starting(self, tokens_left, startup_s):
        return True


def test_draft_catch_up_after_idle_rounds_is_bounded_and_output_unchanged(int8_pair):
    """After rounds without drafting, the draft is fed only its `max_catchup` newest unseen
    tokens (a hole in its context); greedy output still equals target-only."""
    target, draft = int8_pair
    n = 60
    plain = LLM(target).generate(PROMPT, greedy(n))[0].outputs[0]
    llm = LLM(target, draft=target, speculative_config=spec(3))
    drafter = llm.engine.spec.model
    fed = []
    forward = drafter.runner.forward
    drafter.runner.forward = lambda rows, *a, **kw: fed.append([len(r) for r in rows]) or forward(rows, *a, **kw)
    llm.engine.add_request(PROMPT, greedy(n))
    (seq,) = llm.engine.scheduler.waiting
    llm.engine.spec.state(seq).policy = Scripted([0] * 12 + [3, 3])
    skipped = []
    while llm.engine.has_unfinished():
        llm.engine.step()
        state = drafter._seqs.get(seq.seq_id)
        if state is not None:
            skipped.append(state.skipped)
    out = seq
    assert out.token_ids[len(PROMPT):] == plain.token_ids
    # the draft starts at the first decode round (deferred past the target's prefill) and is
    # fed all but the newest token (the first catch-up feeds that one)
    assert fed[0] == [len(PROMPT)]
    assert max(r for rows in fed[1:] for r in rows) == drafter.max_catchup
    assert skipped[-1] > 0
    # the identical draft still agrees with the target after the hole (greedy, same weights
    # but a shifted context: most drafts are still accepted)
    assert seq.metrics.accepted > 0


def test_unbounded_catch_up_feeds_every_unseen_token(int8_pair):
    target, _ = int8_pair
    llm = LLM(target, draft=target, speculative_config=spec(3))
    drafter = llm.engine.spec.model
    drafter.max_catchup = None
    llm.engine.add_request(PROMPT, greedy(40))
    (seq,) = llm.engine.scheduler.waiting
    llm.engine.spec.state(seq).policy = Scripted([0] * 12 + [3])
    while llm.engine.has_unfinished():
        llm.engine.step()
        state = drafter._seqs.get(seq.seq_id)
        if state is not None:
            assert state.skipped == 0
    # an identical draft with its full context accepts every draft
    assert seq.metrics.accepted == seq.metrics.drafted > 0


def test_cost_aware_engine_starts_calibrated(int8_pair, monkeypatch):
    """cost_aware's cost model is seeded at start-up from timed passes of both models: the
    constructor's own calibration run (watched, not replaced) is what the cost model holds
    (made non-decreasing in k where noise inverted it)."""
    target, draft = int8_pair
    runs = []

    def watched(cost, runner, draft_runner, cap):
        runs.append(((cost, runner, draft_runner), calibrate(cost, runner, draft_runner, cap)))
        threads.append(threading.current_thread())
        return runs[-1][1]

    threads = []

    monkeypatch.setattr(calibration, "calibrate", watched)
    llm = LLM(target, draft=draft, speculative_config=spec(-1, max_k=5))
    assert len(runs) == 1
    assert threads[0] is threading.current_thread()  # the thread that builds it
    (cost, runner, draft_runner), measured = runs[0]
    assert cost is llm.engine.spec.cost and runner is llm.engine.runner
    assert draft_runner is llm.engine.spec.model.runner
    assert sorted(measured["verify_s"]) == list(range(6))
    assert measured["draft_step_s"] > 0
    cost = llm.engine.cost
    for k, seconds in non_decreasing(measured["verify_s"]).items():  # inversions pooled
        assert cost.verify_time(k) == seconds
    assert cost.draft_time(3) == pytest.approx(3 * measured["draft_step_s"])
    # a draft start is priced per prefill position from a timed many-row draft pass
    assert measured["draft_prefill_s"] > 0
    assert cost.draft_prefill_time(100) == pytest.approx(100 * measured["draft_prefill_s"])
    # a fixed-k engine does not spend start-up time calibrating
    assert LLM(target, draft=draft, speculative_config=spec(2)).engine.cost.verify_time(0) == 1.0
    assert len(runs) == 1


def test_a_deferred_start_up_is_timed_on_the_engine_thread_before_it_serves(int8_pair,
                                                                            monkeypatch):
    """`defer_startup` (the server's): the timed passes run on the AsyncEngine's thread, the
    one that then runs every step, before the AsyncEngine is handed out; a failure there is
    raised from `async_engine()`."""
    target, draft = int8_pair
    threads = []

    def watched(*args):
        threads.append(threading.current_thread())
        return calibrate(*args)

    monkeypatch.setattr(calibration, "calibrate", watched)
    llm = LLM(target, draft=draft, speculative_config=spec(-1, max_k=3), defer_startup=True)
    assert threads == [] and not llm.engine.started
    engine = llm.async_engine()
    try:
        assert threads == [engine._thread] and llm.engine.started
        assert llm.engine.cost.verify_time(0) != 1.0  # seeded
        out = llm.generate(PROMPT, greedy(8))[0].outputs[0]
        assert threads == [engine._thread] and len(out.token_ids) == 8
    finally:
        engine.shutdown(0)

    def broken(*args):
        raise RuntimeError("no room for a timing pass")

    monkeypatch.setattr(calibration, "calibrate", broken)
    failing = LLM(target, draft=draft, speculative_config=spec(-1, max_k=3), defer_startup=True)
    with pytest.raises(RuntimeError, match="no room"):
        failing.async_engine()
    # used offline instead, the first step runs it on the stepping thread
    monkeypatch.setattr(calibration, "calibrate", watched)
    offline = LLM(target, draft=draft, speculative_config=spec(-1, max_k=3), defer_startup=True)
    offline.generate(PROMPT, greedy(4))
    assert threads[-1] is threading.current_thread() and offline.engine.started


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_lookup_led_methods_greedy_equal_target_only(int8_pair, method):
    target, draft = int8_pair
    plain = LLM(target).generate(PROMPT, greedy(48))[0].outputs[0]
    llm = LLM(target, draft=draft, speculative_config={"method": method, "model": "draft"})
    out = llm.generate(PROMPT, greedy(48))[0].outputs[0]
    assert out.token_ids == plain.token_ids


def test_a_second_request_repeating_the_first_ones_output_drafts_from_it(int8_pair):
    """Cross-request reuse: the first request's output joins the shared cache; the second
    request (same prompt, greedy: the same answer) gets candidates from it, which the first
    never had, and accepts at least as much as with the cache off. Outputs are identical."""
    target, _ = int8_pair
    prompt, n = [7, 91, 12, 64, 3, 77, 105, 21], 64
    accepted = {}
    for tokens in (0, 1 << 16):
        llm = LLM(target, speculative_config={"method": "suffix", "suffix_cache_tokens": tokens,
                                              "num_speculative_tokens": 8})
        lookup, seen = llm.engine.spec.lookup, []
        candidate = lookup.candidate
        lookup.candidate = lambda seq, limit, extra=(): seen.append(
            c := candidate(seq, limit, extra)) or c
        first = llm.generate(prompt, greedy(n))[0].outputs[0]
        in_first = len(seen)
        second = llm.generate(prompt, greedy(n))[0].outputs[0]
        assert second.token_ids == first.token_ids
        assert not any(c.from_cache for c in seen[:in_first])
        from_cache = [c for c in seen[in_first:] if c.from_cache]
        if tokens:
            # both outputs kept, each led by its prompt (shorter than PROMPT_CONTEXT)
            assert lookup.cache.num_tokens == 2 * (len(prompt) + n) and from_cache
        else:
            assert lookup.cache is None and not from_cache
        accepted[tokens] = second.spec.accepted
    assert accepted[1 << 16] >= accepted[0] and accepted[1 << 16] >= 0.8 * n


def test_eight_hybrid_requests_at_once_equal_target_only(int8_pair):
    target, draft = int8_pair
    prompts = [[(7 * i + j) % 100 + 3 for j in range(6 + i)] for i in range(8)]
    plain = [o.outputs[0].token_ids for o in LLM(target).generate(prompts, greedy(32))]
    llm = LLM(target, draft=draft, max_num_seqs=8,
              speculative_config={"method": "hybrid", "model": "draft"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(32))] == plain


def test_timed_passes_that_other_work_disturbed_run_again_when_the_engine_is_idle(
        int8_pair, monkeypatch):
    """Start-up timed passes during which the engine's thread did not run are not trusted:
    the cost model is seeded with them (a busy machine's figures), and they run again at the
    engine's idle moments, on its thread, until they run undisturbed; requests are served
    meanwhile, and a later settled run seeds the cost model anew."""
    from specserve.clients import async_engine as async_module

    target, draft = int8_pair
    monkeypatch.setattr(calibration, "CALIBRATION_PATIENCE_S", 0.0)
    monkeypatch.setattr(calibration, "SETTLED_SHARE", 2.0)  # every call looks disturbed
    monkeypatch.setattr(async_module, "IDLE_WORK_AFTER_S", 0.05)
    threads = []

    def watched(*args, **kwargs):
        threads.append(threading.current_thread())
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", watched)
    llm = LLM(target, draft=draft, speculative_config=spec(-1, max_k=3), defer_startup=True)
    plain = LLM(target).generate(PROMPT, greedy(12))[0].outputs[0]
    engine = llm.async_engine()
    try:
        assert llm.engine.has_idle_work and llm.engine.cost.verify_time(0) != 1.0
        deadline = time.monotonic() + 30
        while len(threads) < 3 and time.monotonic() < deadline:  # still disturbed: retried
            time.sleep(0.02)
        assert len(threads) >= 3 and set(threads) == {engine._thread}
        out = llm.generate(PROMPT, greedy(12))[0].outputs[0]
        assert out.token_ids == plain.token_ids  # served meanwhile, exactly
        seeded = llm.engine.cost.snapshot()
        monkeypatch.setattr(calibration, "SETTLED_SHARE", 0.0)  # the machine is quiet again
        while llm.engine.has_idle_work and time.monotonic() < deadline + 30:
            time.sleep(0.02)
        assert not llm.engine.has_idle_work
        assert llm.engine.cost.snapshot() != seeded  # seeded anew from the settled passes
        out = llm.generate(PROMPT, greedy(12))[0].outputs[0]
        assert out.token_ids == plain.token_ids
    finally:
        engine.shutdown(0)


def test_idle_work_stops_at_its_budget_and_measures_nothing(int8_pair, monkeypatch):
    """Idle work (the cost model's disturbed passes again) ends between two passes once its
    budget is spent: nothing it measured is used, it stays pending, and the engine lives on
    (on a loaded machine the whole run outlasted the step watchdog and killed the engine)."""
    from specserve.clients import async_engine as async_module

    target, draft = int8_pair
    monkeypatch.setattr(calibration, "CALIBRATION_PATIENCE_S", 0.0)
    monkeypatch.setattr(calibration, "SETTLED_SHARE", 2.0)  # start-up disturbed: work left
    monkeypatch.setattr(async_module, "IDLE_WORK_AFTER_S", 0.05)
    monkeypatch.setattr(async_module, "IDLE_WORK_BUDGET_S", 0.0)
    stopped = []

    def watched(*args, **kwargs):
        out = calibrate(*args, **kwargs)
        if kwargs.get("interrupted") is not None:  # an idle run, not the start-up one
            stopped.append(kwargs["interrupted"]())
        return out

    monkeypatch.setattr(calibration, "calibrate", watched)
    llm = LLM(target, draft=draft, speculative_config=spec(-1, max_k=3), defer_startup=True)
    engine = llm.async_engine()
    try:
        seeded = llm.engine.cost.snapshot()
        monkeypatch.setattr(calibration, "SETTLED_SHARE", 0.0)  # settled: only the budget stops
        deadline = time.monotonic() + 30
        while len(stopped) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(stopped) >= 3 and all(stopped)  # the idle runs, each out of budget
        assert llm.engine.has_idle_work and llm.engine.cost.snapshot() == seeded
        assert engine.dead_reason is None
    finally:
        engine.shutdown(0)

