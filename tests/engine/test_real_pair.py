"""The default pair from the cache: greedy speculative decoding in float32 equals greedy
target-only decoding on the code workload."""

from __future__ import annotations

from specserve.bench import workloads
from specserve.llm import LLM
from specserve.weights.loader import load_model
from specserve.sampling.params import SamplingParams
from tests.conftest import real_model_path


def test_default_pair_greedy_speculative_equals_target_only(two_threads):
    target = load_model(real_model_path("qwen2.5-coder-1.5b"), "float32")
    draft = load_model(real_model_path("qwen2.5-coder-0.5b"), "float32")
    messages = [{"role": "user", "content": workloads.load("code_edit")}]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = LLM(target, max_num_seqs=1, max_model_len=2048).chat(messages, params)[0].outputs[0]
    spec = LLM(target, draft=draft, max_num_seqs=1, max_model_len=2048, speculative_config={
        "method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4,
    }).chat(messages, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert len(plain.token_ids) == 64
    assert spec.spec.accepted > 0  # a same-family draft on code is accepted often


def test_default_pair_hybrid_greedy_equals_target_only_alone_and_eight_at_once(two_threads):
    """The default speculation (hybrid: suffix drafting and the draft model under one budget)
    on the int4 default pair, one request and eight different ones in one batch."""
    target = load_model(real_model_path("qwen2.5-coder-1.5b"))
    draft = load_model(real_model_path("qwen2.5-coder-0.5b"))
    code = workloads.load("code_edit")
    chats = [[{"role": "user", "content": code}]] + [
        [{"role": "user", "content": f"{q} Answer in two sentences."}]
        for q in ("What is a hash map?", "Why do caches have lines?", "What does TCP do?",
                  "What is a mutex?", "Explain recursion.", "What is a B-tree?",
                  "What is a closure in Python?")]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids
             for o in LLM(target, max_num_seqs=8, max_model_len=2048).chat(chats, params)]
    hybrid = LLM(target, draft=draft, max_num_seqs=8, max_model_len=2048,
                 speculative_config={"model": "qwen2.5-coder-0.5b"})  # method hybrid by default
    assert hybrid.spec.method == "hybrid"
    alone = hybrid.chat(chats[0], params)[0].outputs[0]
    assert alone.token_ids == plain[0] and alone.spec.accepted > 0
    together = [o.outputs[0].token_ids for o in hybrid.chat(chats, params)]
    assert together == plain
