"""The engine on each prefill path (`prefill_path`, `engine/prefill_choice.py`), forced on
whatever machine runs this: target-only and speculative decoding prefill the same prompt
through the same path (greedy outputs equal); a request's tokens do not depend on what shares
its passes, on preemption or on a prefix-cache hit; the path is really taken; "auto" takes the
faster path per part from what it timed."""

from __future__ import annotations

import json

import pytest

from specserve.engine import prefill_choice
from specserve.engine.prefill_choice import Timing, decide
from specserve.llm import LLM
from specserve.models.prefill import NATIVE, ONEDNN, PROJECTIONS
from specserve.sampling.params import SamplingParams
from specserve.weights.loader import load_model
from tests import tiny
from tests.engine.test_batching import SPECS, greedy, prompts, run

PATHS = ["native", "onednn"]


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    paths = [tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=seed),
                              tmp_path_factory.mktemp(f"m{seed}")) for seed in (0, 1)]
    return tuple(load_model(p, "float32", weights="int4") for p in paths)


def make_llm(pair, spec_name: str, path: str, **kw) -> LLM:
    target, draft = pair
    return LLM(target, draft=draft if spec_name == "draft" else None,
               speculative_config=SPECS[spec_name], max_model_len=256, prefill_path=path, **kw)


def alone(pair, spec_name, path, prompt, params):
    return run(make_llm(pair, spec_name, path).engine, [(0, prompt, params)])[0]


def scored(n: int) -> SamplingParams:
    """Greedy, `n` tokens, each with its logprob: the logprobs carry every bit of the keys
    before it, where a greedy token of a tiny model rarely flips."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def generated(llm: LLM, prompt_list: list[list[int]], params: list[SamplingParams]) -> list:
    """(token ids, logprobs) of each prompt's completion, all submitted at once."""
    outs = llm.generate(prompt_list, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("spec_name", ["draft", "ngram"])
def test_greedy_speculative_equals_target_only_on_the_onednn_path(int4_pair, spec_name):
    for prompt in prompts(4):
        params = greedy(24)
        plain = alone(int4_pair, "plain", "onednn", prompt, params)
        assert alone(int4_pair, spec_name, "onednn", prompt, params) == plain


def test_staggered_requests_give_exactly_their_tokens_alone_on_the_onednn_path(int4_pair):
    params = [greedy(8 + i % 5) for i in range(12)]
    llm = make_llm(int4_pair, "draft", "onednn", max_num_batched_tokens=40)
    batched = run(llm.engine, [(i // 3, p, params[i]) for i, p in enumerate(prompts(12))])
    for i, prompt in enumerate(prompts(12)):
        assert batched[i] == alone(int4_pair, "draft", "onednn", prompt, params[i]), i


def test_a_prompt_chunked_beside_others_gives_the_bits_it_gives_alone_on_the_onednn_path(
        int4_pair):
    """A step budget of 40 rows cuts the prompts into chunks that depend on what else runs."""
    params = [scored(6 + i % 3) for i in range(8)]
    long_prompts = [p * 3 for p in prompts(8)]
    batched = generated(make_llm(int4_pair, "plain", "onednn", max_num_batched_tokens=40),
                        long_prompts, params)
    one = make_llm(int4_pair, "plain", "onednn")
    for i, prompt in enumerate(long_prompts):
        assert batched[i] == generated(one, [prompt], [params[i]])[0], i


def test_preempted_requests_complete_exactly_on_the_onednn_path(int4_pair):
    """A recomputation feeds output tokens as a chunk after the prompt: they keep the decode
    rows' path, so the logprobs after a preemption are the bits of a run without one."""
    target = int4_pair[0].model
    per_token = target.kv_bytes_per_token(target.kv_cache_dtype())
    llm = make_llm(int4_pair, "plain", "onednn", kv_cache_memory=20 * 16 * per_token)
    params = [scored(30 + i % 7) for i in range(12)]
    batched = generated(llm, prompts(12), params)
    assert llm.engine.stats().preemptions > 0
    one = make_llm(int4_pair, "plain", "onednn")
    for i, prompt in enumerate(prompts(12)):
        assert batched[i] == generated(one, [prompt], [params[i]])[0], i


def test_a_prefix_cache_hit_gives_the_cold_prefill_bits_on_the_onednn_path(int4_pair):
    shared = [(11 * j) % 100 + 3 for j in range(100)]
    first, second = shared + [7, 8, 9], shared[:96] + [21, 22, 23, 24, 25]
    llm = make_llm(int4_pair, "plain", "onednn")
    generated(llm, [first], [scored(6)])
    hits = llm.engine.stats().prefix_cache_hit_tokens
    warm = generated(llm, [second], [scored(12)])
    assert llm.engine.stats().prefix_cache_hit_tokens - hits == 96
    assert warm == generated(make_llm(int4_pair, "plain", "onednn"), [second], [scored(12)])


def first_logprobs(pair, path: str) -> dict:
    llm = make_llm(pair, "plain", path)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    out = llm.generate(prompts(1)[0][:30], params)[0].outputs[0]
    return out.logprobs[0]


def test_the_engine_takes_the_path_it_reports(int4_pair, tmp_path, caplog):
    trace = tmp_path / "trace.jsonl"
    with caplog.at_level("INFO", logger="specserve.engine"):
        llm = make_llm(int4_pair, "plain", "onednn", trace_steps=str(trace))
    assert f"prefill path: {ONEDNN.label()}; dense bf16 copies" in caplog.text  # start-up line
    assert llm.engine.runner.prefill == ONEDNN
    stats = llm.engine.stats()
    assert dict(stats.prefill_onednn) == {p: True for p in (*PROJECTIONS, "attention")}
    assert stats.prefill_dense_bytes > 0
    llm.generate(prompts(1)[0], greedy(2))
    assert json.loads(trace.read_text().splitlines()[0])["prefill_path"] == ONEDNN.label()
    # the prompt's logits differ from the int4 kernels' (the path ran), and not by much
    on, off = first_logprobs(int4_pair, "onednn"), first_logprobs(int4_pair, "native")
    assert on != off
    assert max(abs(on[t] - off[t]) for t in on.keys() & off.keys()) < 0.5
    native = make_llm(int4_pair, "plain", "native").engine
    assert native.runner.prefill == NATIVE and native.stats().prefill_dense_bytes == 0


def timing(part: str, native: float, onednn: float, context: int = 0, rows: int = 64) -> Timing:
    return Timing(part, rows, native, onednn, context)


def test_auto_takes_onednn_for_each_projection_faster_there_over_the_rows_timed():
    timings = [timing("qkv", 2.0, 1.0), timing("qkv", 1.0, 1.5, rows=16),  # 3.0 vs 2.5
               timing("o", 1.0, 1.2), timing("gate_up", 5.0, 4.0), timing("down", 1.0, 1.0)]
    choice = decide(timings)
    assert choice.projections == ("qkv", "gate_up") and choice.attention_from is None
    assert choice.timings == tuple(timings)
    flipped = decide([Timing(t.part, t.rows, t.onednn_s, t.native_s) for t in timings])
    assert flipped.projections == ("o",)  # the faster side, not a fixed one
    close = [timing("qkv", 1.0, 0.95), timing("attention", 1.0, 0.95, 1024, 256)]
    assert not decide(close).active  # faster within the margin: nothing moves


def test_auto_moves_nothing_on_timings_other_work_disturbed():
    timings = [timing("qkv", 2.0, 1.0), timing("attention", 1.0, 0.5, 1024, 256)]
    assert decide(timings).active
    kept = decide(timings, disturbed=True)
    assert not kept.active and kept.disturbed and kept.timings == tuple(timings)


def test_auto_takes_onednn_attention_from_the_context_where_it_wins_from_there_up():
    def attention(wins: tuple[bool, bool, bool]):
        return [timing("attention", 1.0, 0.5 if w else 2.0, c, 256)
                for c, w in zip((1024, 8192, 16384), wins)]

    assert decide(attention((True, True, True))).attention_from == 0
    assert decide(attention((False, True, True))).attention_from == 8192 - 256
    assert decide(attention((False, False, True))).attention_from == 16384 - 256
    assert decide(attention((True, False, True))).attention_from == 16384 - 256
    assert decide(attention((False, False, False))).attention_from is None
    assert decide(attention((True, True, False))).attention_from is None
    assert decide([]) == NATIVE


def test_auto_times_every_part_on_the_models_own_shapes_once_per_model(tmp_path):
    """Timed once per loaded model: every later engine over it takes that choice (engines
    over one model, e.g. target-only and speculative, prefill through one path even where
    noisy timings of close paths would flip)."""
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=2), tmp_path / "m")
    loaded = load_model(path, "float32", weights="int4")
    model = loaded.model
    choice = prefill_choice.choose(model, "auto", 64, 256, model.kv_cache_dtype(), 0.0)
    parts = {(t.part, t.rows) for t in choice.timings}
    assert parts == {(p, r) for p in PROJECTIONS for r in (16, 64)} | {("attention", 64)}
    assert all(t.native_s > 0 and t.onednn_s > 0 for t in choice.timings)
    assert choice == decide(list(choice.timings), choice.disturbed)
    assert prefill_choice.choose(model, "auto", 128, 4096, model.kv_cache_dtype(), 0.0) \
        is choice
    llms = [LLM(loaded, speculative_config=None, max_num_batched_tokens=n) for n in (32, 96)]
    assert all(llm.engine.runner.prefill is choice for llm in llms)
    other = load_model(path, "float32", weights="int4").model  # another load: timed anew
    again = prefill_choice.choose(other, "auto", 64, 256, other.kv_cache_dtype(), 0.0)
    assert again is not choice and {(t.part, t.rows) for t in again.timings} == parts


def test_a_model_without_int4_projections_has_no_prefill_path(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path / "m")
    dense = load_model(path, "float32", weights="float32")
    assert LLM(dense, speculative_config=None).engine.runner.prefill == NATIVE  # auto
    with pytest.raises(ValueError, match="prefill_path='onednn' needs a quantized model"):
        LLM(dense, speculative_config=None, prefill_path="onednn")


def test_an_unknown_prefill_path_is_refused_by_name(int4_pair):
    with pytest.raises(ValueError, match="prefill_path must be one of"):
        make_llm(int4_pair, "plain", "amx")
