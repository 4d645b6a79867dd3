"""A request's tokens do not depend on what else the engine runs: staggered arrivals, batches of
more than 64 rows, chunked prefill, preemption and prefix reuse all give exactly the tokens the
request gives alone. Tiny random models, float32 and int4 (native kernels)."""

from __future__ import annotations

import pytest

from specserve.engine.outputs import SpeculationOverride
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests import tiny

NUM_REQUESTS = 16


@pytest.fixture(scope="module", params=["float32", "int4"])
def models(request, tmp_path_factory):
    weights = "bf16" if request.param == "float32" else "int4"
    paths = [tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=seed), tmp_path_factory.mktemp(f"m{seed}"))
             for seed in (0, 1)]
    return tuple(load_model(p, "float32", weights=weights) for p in paths)


def prompts(n: int = NUM_REQUESTS) -> list[list[int]]:
    """Different lengths (3..48 tokens), some with repeats for the n-gram drafter to find."""
    out = []
    for i in range(n):
        length = 3 + (i * 7) % 46
        base = [(5 + 13 * i + 7 * j) % 100 + 3 for j in range(6)]
        out.append([base[j % len(base)] if j % 3 else (j * 11 + i) % 100 + 3 for j in range(length)])
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


SPECS = {
    "plain": None,
    "draft": {"method": "draft_model", "model": "draft", "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
}


def make_llm(models, spec_name: str, **kw) -> LLM:
    target, draft = models
    return LLM(target, draft=draft if spec_name == "draft" else None,
               speculative_config=SPECS[spec_name], max_model_len=256, **kw)


def run(engine, arrivals: list[tuple[int, list[int], SamplingParams]], watch=None) -> dict:
    """Add `(step, prompt, params)` requests at their steps; step until all finish. Returns
    request index → the completions' token ids. `watch(engine)` runs after every step."""
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    ids, done, step = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            ids[engine.add_request(prompt, params)] = i
        for delta in engine.step():
            if delta.finished:
                done[ids[delta.request_id]] = [c.token_ids for c in delta.output.outputs]
        if watch is not None:
            watch(engine)
        step += 1
    return done


def alone(models, spec_name: str, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return run(make_llm(models, spec_name).engine, [(0, prompt, params)])[0]


def widest_pass(llm: LLM) -> list[int]:
    """Record the number of rows of every target pass."""
    widths = []
    forward = llm.engine.runner.forward

    def recording(rows, *args, **kw):
        widths.append(sum(len(r) for r in rows))
        return forward(rows, *args, **kw)

    llm.engine.runner.forward = recording
    return widths


@pytest.mark.parametrize("spec_name", ["plain", "draft", "ngram"])
def test_staggered_requests_give_exactly_their_tokens_alone(models, spec_name):
    params = [greedy(8 + i % 5) for i in range(NUM_REQUESTS)]
    batched_llm = make_llm(models, spec_name)
    widths = widest_pass(batched_llm)
    arrivals = [(i // 3, p, params[i]) for i, p in enumerate(prompts())]  # 3 join per step
    batched = run(batched_llm.engine, arrivals)
    for i, prompt in enumerate(prompts()):
        assert batched[i] == alone(models, spec_name, prompt, params[i]), f"request {i}"
    assert max(widths) > 64  # one pass verified / prefilled more than 64 rows
    if spec_name != "plain":
        assert batched_llm.engine.metrics.total.drafted > 0


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched(models):
    for spec_name in ("plain", "draft"):
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=10,
                                 ignore_eos=True) for i in range(8)]
        short = [p[:12] for p in prompts(8)]
        batched = run(make_llm(models, spec_name).engine,
                      [(i // 2, p, params[i]) for i, p in enumerate(short)])
        for i, prompt in enumerate(short):
            assert batched[i] == alone(models, spec_name, prompt, params[i]), (spec_name, i)


@pytest.mark.parametrize("spec_name", ["plain", "draft"])
def test_a_kv_budget_too_small_for_all_preempts_and_every_request_completes_exactly(
        models, spec_name):
    target, draft = models
    per_token = target.model.kv_bytes_per_token(target.model.kv_cache_dtype()) + (
        draft.model.kv_bytes_per_token(draft.model.kv_cache_dtype()) if spec_name == "draft"
        else 0)  # in the dtype the engine's "auto" gives each model
    # 20 blocks of 16 positions: room for the longest sequence (max_model_len 256 + drafts)
    # but not for 12 requests of ~60 positions each at once
    llm = make_llm(models, spec_name, kv_cache_memory=20 * 16 * per_token)
    assert llm.engine.stats().kv_blocks_total == 20
    params = [greedy(30 + i % 7) for i in range(12)]
    batched = run(llm.engine, [(0, p, params[i]) for i, p in enumerate(prompts(12))])
    assert len(batched) == 12
    assert llm.engine.stats().preemptions > 0
    for i, prompt in enumerate(prompts(12)):
        assert batched[i] == alone(models, spec_name, prompt, params[i]), f"request {i}"
    assert llm.engine.stats().kv_blocks_used == 0  # everything finished: nothing held


def test_running_requests_keep_producing_tokens_between_the_chunks_of_a_long_prompt(models):
    llm = make_llm(models, "plain", max_num_batched_tokens=32)
    engine = llm.engine
    for p in prompts(4):
        engine.add_request(p[:5], greedy(60))
    for _ in range(3):
        engine.step()
    running = list(engine.scheduler.running)
    long_prompt = [(7 * j) % 100 + 3 for j in range(200)]
    engine.add_request(long_prompt, greedy(4))
    chunk_steps = 0
    while True:
        before = [len(s.token_ids) for s in running]
        engine.step()
        (newcomer,) = [s for s in engine.scheduler.running if s.prompt_len == 200]
        assert all(len(s.token_ids) > b for s, b in zip(running, before))
        chunk_steps += 1
        if not newcomer.prefilling:
            break
    # 200 prompt tokens, at most 32 - 4 per step beside the four decoding rows
    assert chunk_steps >= 200 // 28
    while engine.has_unfinished():
        engine.step()
    assert newcomer.num_output == 4


@pytest.mark.parametrize("spec_name", ["plain", "draft"])
def test_a_shared_prefix_is_prefilled_once_and_gives_the_cold_cache_tokens(models, spec_name):
    shared = [(11 * j) % 100 + 3 for j in range(100)]
    first, second = shared + [7, 8, 9], shared[:96] + [21, 22, 23, 24, 25]
    llm = make_llm(models, spec_name)
    engine = llm.engine
    run(engine, [(0, first, greedy(6))])
    computed, hits = engine.stats().prompt_tokens_computed, engine.stats().prefix_cache_hit_tokens
    warm = run(engine, [(0, second, greedy(12))])[0]
    assert engine.stats().prefix_cache_hit_tokens - hits == 96  # six full blocks of 16
    assert engine.stats().prompt_tokens_computed - computed == len(second) - 96
    if spec_name == "draft":
        assert engine.spec.model.prefix_hit_tokens >= 96
    assert warm == alone(models, spec_name, second, greedy(12))


@pytest.mark.parametrize("spec_name", ["plain", "draft"])
def test_with_prefix_caching_off_a_repeated_prompt_is_prefilled_again(models, spec_name):
    prompt = [(11 * j) % 100 + 3 for j in range(100)]
    llm = make_llm(models, spec_name, enable_prefix_caching=False)
    engine = llm.engine
    first = run(engine, [(0, prompt, greedy(6))])[0]
    computed = engine.stats().prompt_tokens_computed
    again = run(engine, [(0, prompt, greedy(6))])[0]
    assert engine.stats().prefix_cache_hit_tokens == 0
    assert engine.stats().prompt_tokens_computed - computed == len(prompt)
    if spec_name == "draft":
        assert engine.spec.model.prefix_hit_tokens == 0
    assert again == first


@pytest.mark.parametrize("spec_name", ["plain", "draft"])
def test_after_reset_prefix_cache_a_repeated_prompt_is_prefilled_again(models, spec_name):
    prompt = [(11 * j) % 100 + 3 for j in range(100)]
    llm = make_llm(models, spec_name)
    engine = llm.engine
    first = run(engine, [(0, prompt, greedy(6))])[0]
    assert llm.reset_prefix_cache() > 0
    computed, hits = engine.stats().prompt_tokens_computed, engine.stats().prefix_cache_hit_tokens
    draft_hits = engine.spec.model.prefix_hit_tokens if spec_name == "draft" else 0
    again = run(engine, [(0, prompt, greedy(6))])[0]
    assert engine.stats().prefix_cache_hit_tokens == hits
    assert engine.stats().prompt_tokens_computed - computed == len(prompt)
    if spec_name == "draft":
        assert engine.spec.model.prefix_hit_tokens == draft_hits
    assert again == first
    # the cache fills again: a third run is served from it
    run(engine, [(0, prompt, greedy(6))])
    assert engine.stats().prefix_cache_hit_tokens - hits == 96


def test_disable_by_batch_size_pauses_drafting_at_that_many_running_and_resumes_below(models):
    spec = dict(SPECS["draft"], disable_by_batch_size=3)
    target, draft = models
    llm = LLM(target, draft=draft, speculative_config=spec, max_model_len=256)
    engine = llm.engine
    log = []  # (running sequences, some drafted) per step
    propose = engine.spec.model.propose

    def recording(seqs, ks):
        log[-1][1] |= any(ks)
        return propose(seqs, ks)

    engine.spec.model.propose = recording

    def step():
        log.append([len([s for s in engine.scheduler.running if not s.prefilling]), False])
        engine.step()

    ps = prompts(4)
    engine.add_request(ps[0][:6], greedy(80))
    for _ in range(6):
        step()
    for p in ps[1:]:
        engine.add_request(p[:6], greedy(12))
    while engine.has_unfinished():
        step()
    assert any(drafted for n, drafted in log if n == 1)  # alone at first: drafts
    crowded = [drafted for n, drafted in log if n >= 3]
    assert crowded and not any(crowded)  # at 3 running and more: never
    last_crowded = max(i for i, (n, _) in enumerate(log) if n >= 3)
    assert any(drafted for _, drafted in log[last_crowded + 1:])  # fewer again: drafts again


def test_per_request_speculation_overrides(models):
    llm = make_llm(models, "draft")
    engine = llm.engine
    prompt = prompts(1)[0]
    off = engine.add_request(prompt, greedy(20), speculation=SpeculationOverride(enabled=False))
    two = engine.add_request(prompt, greedy(20),
                             speculation=SpeculationOverride(num_speculative_tokens=2))
    default = engine.add_request(prompt, greedy(20))
    outs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                outs[delta.request_id] = delta.output.outputs[0]
    assert outs[off].spec.drafted == 0
    assert max(outs[two].spec.k_histogram) == 2
    assert max(outs[default].spec.k_histogram) == 4
    assert outs[off].token_ids == outs[two].token_ids == outs[default].token_ids
