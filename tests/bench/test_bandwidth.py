"""The decode ceiling's byte count: every weight a decode step reads, once each, also when the
weights are views of one memory-mapped storage (the weight cache)."""

from __future__ import annotations

import torch

from specserve.bench.bandwidth import _tensor_bytes, ceiling, decode_bytes_per_token
from specserve.weights.loader import load_model
from tests import tiny


def test_views_of_one_storage_are_each_counted_and_a_repeated_tensor_once():
    storage = torch.zeros(1000, dtype=torch.float32)
    a, b = storage[:300], storage[300:1000]
    seen: set = set()
    assert _tensor_bytes(a, seen) + _tensor_bytes(b, seen) + _tensor_bytes(a, seen) == 4000


def test_a_float_model_reads_its_weights_and_one_embedding_row_per_token(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "m")
    model = load_model(path, "float32", weights="float32").model
    c = model.cfg
    weights = sum(getattr(layer, n).weight.numel() for layer in model.layers
                  for n in ("qkv", "o", "gate_up", "down"))
    weights += sum(l.attn_norm.numel() + l.mlp_norm.numel() for l in model.layers)
    weights += model.norm.numel() + model.lm_head.weight.numel()
    tied = model.lm_head.weight.data_ptr() == model.embed.data_ptr()
    expected = 4 * (weights + (0 if tied else c.hidden_size))
    assert decode_bytes_per_token(model) == expected
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert decode_bytes_per_token(model, context=10) == expected + 10 * kv
    assert decode_bytes_per_token(model, context=10, kv_dtype=torch.float16) == expected + 5 * kv
    assert ceiling(model, 1e9)["ceiling_tokens_per_s"] == 1e9 / expected
