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
