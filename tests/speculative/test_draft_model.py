"""The draft model's deferred, windowed start: nothing of the draft runs before a sequence's
first token, a starting draft is fed at most `prefill_window` tokens (within the call's
prefill budget), a cost-aware request too short to repay the start never starts it, and
greedy output stays the target's token for token throughout."""

from __future__ import annotations


from specserve.llm import LLM
from tests import tiny

PROMPT = [(7 * j) % 90 + 5 for j in range(100)]


spec = tiny.draft_spec


greedy = tiny.greedy


def plain(target, prompt, n, **kw):
    return LLM(target, **kw).generate(prompt, greedy(n))[0].outputs[0].token_ids


def record_passes(drafter) -> list[list[int]]:
    """Row lengths of every pass the draft model runs, from now on."""
    passes = []
    forward = drafter.runner.forward

    def recording(rows, starts, tables, last_n=None, prefill=None):
        passes.append([len(r) for r in rows])
        return forward(rows, starts, tables, last_n, prefill)

    drafter.runner.forward = recording
    return passes


def test_draft_runs_nothing_until_the_targets_prefill_has_given_the_first_token(int8_pair):
    target, draft = int8_pair
    llm = LLM(target, draft=draft, speculative_config=spec(3), max_num_batched_tokens=32)
    engine = llm.engine
    passes = record_passes(engine.spec.model)
    engine.add_request(PROMPT, greedy(30))
    (seq,) = engine.scheduler.waiting
    prefill_steps = 0
    while seq.num_output == 0:
        engine.step()
        prefill_steps += 1
        assert passes == [], "the draft ran during the target's prefill"
    assert prefill_steps >= len(PROMPT) // 32  # the prompt took several chunked steps
    assert not engine.spec.model.started(seq)
    while engine.has_unfinished():
        engine.step()
    assert passes, "the draft never started"
    assert seq.output_ids == plain(target, PROMPT, 30)
    assert seq.metrics.drafted > 0


def test_a_starting_draft_is_fed_only_the_newest_prefill_window_tokens(int8_pair):
    target, _ = int8_pair
    window = 16
    llm = LLM(target, draft=target, speculative_config=spec(3, prefill_window=window))
    drafter = llm.engine.spec.model
    passes = record_passes(drafter)
    llm.engine.add_request(PROMPT, greedy(40))
    (seq,) = llm.engine.scheduler.waiting
    llm.engine.step()  # the target's prefill: the first token
    llm.engine.step()  # the draft starts: the window in the pass of its first draft step
    state = drafter._seqs[seq.seq_id]
    assert passes[0] == [window]
    assert state.skipped == len(PROMPT) + 1 - window
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert max(sum(rows) for rows in passes) <= window
    assert seq.output_ids == plain(target, PROMPT, 40)
    # the identical draft, from its window alone, still agrees with the target mostly
    assert seq.metrics.accepted > seq.metrics.drafted / 2


def test_a_windowed_start_keeps_the_drafts_prefix_cache_hits(int8_pair):
    target, _ = int8_pair
    shared = PROMPT[:48]  # three full blocks, registered by a first draft that saw them all
    llm = LLM(target, draft=target, speculative_config=spec(2, prefill_window=64))
    drafter = llm.engine.spec.model
    llm.generate(shared, greedy(8))
    hits = drafter.prefix_hit_tokens
    second = shared + [(3 * j) % 80 + 7 for j in range(100)]
    llm.engine.add_request(second, greedy(20))
    (seq,) = llm.engine.scheduler.waiting
    llm.engine.step()
    llm.engine.step()
    state = drafter._seqs[seq.seq_id]
    assert drafter.prefix_hit_tokens - hits == 48
    # the hole lies between the cached prefix and the window of the newest 64 tokens
    assert state.skipped == len(second) + 1 - 64 - 48
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.output_ids == plain(target, second, 20)


def test_a_start_longer_than_the_prefill_budget_is_fed_in_chunks_while_decoding_goes_on(int8_pair):
    target, _ = int8_pair
    llm = LLM(target, draft=target, speculative_config=spec(3, prefill_window=None),
              max_num_batched_tokens=32)
    drafter = llm.engine.spec.model
    passes = record_passes(drafter)
    llm.engine.add_request(PROMPT, greedy(40))
    (seq,) = llm.engine.scheduler.waiting
    while seq.num_output == 0:
        llm.engine.step()
    outputs_while_prefilling = seq.num_output
    llm.engine.step()  # the draft starts: too long to feed at once, so not ready yet
    assert drafter.started(seq) and not drafter.ready(seq)
    while not drafter.ready(seq):
        llm.engine.step()
    assert seq.num_output > outputs_while_prefilling + 1  # plain rounds ran meanwhile
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert max(sum(rows) for rows in passes) <= 32
    assert drafter._seqs.get(seq.seq_id) is None or drafter._seqs[seq.seq_id].skipped == 0
    assert seq.output_ids == plain(target, PROMPT, 40)
    assert seq.metrics.drafted > 0


def test_sequences_starting_together_share_one_calls_prefill_budget(int8_pair):
    target, draft = int8_pair
    prompts = [[(5 * j + i) % 90 + 3 for j in range(30)] for i in range(3)]
    budget = 92  # the three prompts prefill in one step; their three starts (31 each) do not fit
    llm = LLM(target, draft=draft, speculative_config=spec(2, prefill_window=None),
              max_num_batched_tokens=budget)
    passes = record_passes(llm.engine.spec.model)
    outs = llm.generate(prompts, greedy(12))
    assert max(sum(rows) for rows in passes) <= budget
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == plain(target, prompt, 12)


def test_cost_aware_never_starts_the_draft_for_a_short_request_but_does_for_a_long_one(int8_pair):
    """With a draft prefill of 0.4 s to pay (200 positions at 2 ms) and 16 ms saved per token
    at the prior acceptance, 16 tokens do not repay the start and 200 do."""
    target, draft = int8_pair
    prompt = [(7 * j) % 90 + 5 for j in range(200)]

    def run(max_tokens):
        llm = LLM(target, draft=draft, speculative_config=spec(-1, max_k=4, prefill_window=None),
                  max_model_len=512)
        llm.engine.cost.seed(0.01, {k: 0.05 + 0.002 * k for k in range(5)}, draft_prefill_s=0.002)
        out = llm.generate(prompt, greedy(max_tokens))[0].outputs[0]
        assert out.token_ids == plain(target, prompt, max_tokens, max_model_len=512)
        return llm.engine.spec.model.num_started, out

    started, out = run(16)
    assert started == 0 and out.spec.drafted == 0
    started, out = run(200)
    assert started == 1 and out.spec.drafted > 0


def test_speculation_turned_off_per_request_never_starts_the_draft(int8_pair):
    from specserve.engine.outputs import SpeculationOverride

    target, draft = int8_pair
    llm = LLM(target, draft=draft, speculative_config=spec(3))
    passes = record_passes(llm.engine.spec.model)
    llm.engine.add_request(PROMPT, greedy(20), speculation=SpeculationOverride(enabled=False))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert passes == [] and llm.engine.spec.model.num_started == 0
