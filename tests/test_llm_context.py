"""The context an `LLM` takes with no `max_model_len`: the model's trained context, bounded by
what the KV budget holds for one sequence; the budget limits concurrency, not length."""

from __future__ import annotations

from specserve.engine.runner import kv_positions
from specserve.llm import LLM
from specserve.speculative.config import MAX_SPECULATIVE_TOKENS
from specserve.weights.loader import load_model
from tests import tiny


def test_no_max_model_len_takes_the_trained_context_and_a_given_one_is_kept(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path)
    model = load_model(path, "float32")
    trained = model.config.max_position
    assert LLM(model, speculative_config=None).engine.config.max_model_len == trained
    kept = LLM(model, speculative_config=None, max_model_len=trained // 4)
    assert kept.engine.config.max_model_len == trained // 4
    assert LLM(model, speculative_config=None, max_model_len=trained * 8
               ).engine.config.max_model_len == trained


def test_a_kv_budget_short_of_the_trained_context_bounds_the_default_context(tmp_path):
    """A budget of 300 positions (with its rounding to blocks): the default context is what
    one sequence and a round's drafts fit in, not the trained 1,024 (which would not start)."""
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2"), tmp_path)
    model = load_model(path, "float32")
    per_position = model.model.kv_bytes_per_token(model.model.kv_cache_dtype("auto"))
    llm = LLM(model, speculative_config=None, kv_cache_memory=300 * per_position)
    held = kv_positions(model.model, None, 300 * per_position, llm.engine.config.block_size)
    assert held < 300 and llm.engine.config.max_model_len == held - MAX_SPECULATIVE_TOKENS - 1
    assert llm.engine.config.max_model_len < model.config.max_position
    out = llm.generate([[1] * (held - MAX_SPECULATIVE_TOKENS - 2)],
                       None)[0]  # a prompt at the limit still runs
    assert out.outputs[0].num_output_tokens >= 1
