"""The engine option `kv_cache_dtype`: validated before anything loads; "auto" picks float16 for
models on the native glue and the activations' dtype elsewhere, for the target's and the
draft's caches alike; the KV budget buys blocks at the real dtype's size; and greedy
speculative decoding still equals target-only decoding token for token on a float16 cache."""

from __future__ import annotations

import pytest
import torch

from specserve.cli import build_parser
from specserve.engine.engine import EngineConfig
from specserve.engine.runner import build_runners
from specserve.llm import LLM
from specserve.weights.loader import load_model
from tests import tiny

PROMPT = [5, 17, 33, 8, 90, 41]


greedy = tiny.greedy


@pytest.mark.parametrize("bad", ["fp8", "half", "FLOAT16", "", None, torch.float16])
def test_a_bad_kv_cache_dtype_is_refused_before_any_model_loads(tmp_path, bad):
    missing = tmp_path / "no-such-model"  # loading it would fail with another error
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(missing), kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)


def test_the_cli_flags_offer_the_same_names():
    for command in (["generate"], ["serve"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "float16"])
        assert args.kv_cache_dtype == "float16"
        assert build_parser().parse_args(command).kv_cache_dtype == "auto"
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--kv-cache-dtype", "fp8"])


def test_auto_is_float16_on_the_native_glue_for_target_and_draft(int8_pair):
    target, draft = int8_pair  # int8 weights, float32 activations: the native glue
    llm = LLM(target, draft=draft, speculative_config=tiny.draft_spec(3))
    assert llm.engine.runner.cache.keys.dtype == torch.float16
    assert llm.engine.spec.model.runner.cache.keys.dtype == torch.float16
    assert llm.engine.spec.model.runner.cache.values.dtype == torch.float16
    forced = LLM(target, draft=draft, speculative_config=tiny.draft_spec(3),
                 kv_cache_dtype="float32")
    assert forced.engine.runner.cache.keys.dtype == torch.float32
    assert forced.engine.spec.model.runner.cache.keys.dtype == torch.float32


def test_auto_is_the_activations_dtype_off_the_native_glue(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path / "m")
    bf16 = load_model(path, "bfloat16", weights="bf16")
    assert bf16.model.act_dtype == torch.bfloat16
    assert bf16.model.kv_cache_dtype("auto") == torch.bfloat16
    assert bf16.model.kv_cache_dtype("float16") == torch.float16
    llm = LLM(bf16)
    assert llm.engine.runner.cache.keys.dtype == torch.bfloat16
    out = llm.generate(PROMPT, greedy(8))[0].outputs[0]  # the PyTorch path on a bf16 cache
    assert len(out.token_ids) == 8
    half = LLM(bf16, kv_cache_dtype="float16")  # the PyTorch path on a float16 cache
    assert half.engine.runner.cache.keys.dtype == torch.float16
    assert len(half.generate(PROMPT, greedy(8))[0].outputs[0].token_ids) == 8


def test_the_kv_budget_buys_blocks_at_the_cache_dtypes_size(int8_pair):
    target, draft = int8_pair
    per_token32 = target.model.kv_bytes_per_token() + draft.model.kv_bytes_per_token()
    budget = 64 * 16 * per_token32  # 64 float32 blocks of 16 positions for the pair
    blocks = {}
    for name in ("float32", "float16", "bfloat16", "auto"):
        runner, draft_runner = build_runners(target.model, draft.model, budget, 16, 100,
                                             kv_cache_dtype=name)
        assert runner.num_blocks == draft_runner.num_blocks
        assert runner.cache.keys.shape[1] == runner.num_blocks
        blocks[name] = runner.num_blocks
    assert blocks == {"float32": 64, "float16": 128, "bfloat16": 128, "auto": 128}


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])
@pytest.mark.parametrize("same_draft", [True, False])
def test_greedy_speculative_equals_target_only_on_the_cache_dtype(int8_pair, kv_cache_dtype,
                                                                  same_draft):
    """An identical draft (everything accepted) and an unrelated one (mostly rejected)."""
    target, other = int8_pair
    draft = target if same_draft else other
    n = 40
    plain = LLM(target, kv_cache_dtype=kv_cache_dtype).generate(PROMPT, greedy(n))[0].outputs[0]
    fast = LLM(target, draft=draft, speculative_config=tiny.draft_spec(3),
               kv_cache_dtype=kv_cache_dtype).generate(PROMPT, greedy(n))[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    assert len(plain.token_ids) == n
    if same_draft:
        assert fast.spec.accepted == fast.spec.drafted > 0
    else:
        assert fast.spec.acceptance_rate < 0.3
