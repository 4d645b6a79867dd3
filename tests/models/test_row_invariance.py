"""End to end: a tiny model's logits for a prompt are the same bits alone and batched with
others, on the native kernels (float32 weights on `f_matmul`, int4 on `q_matmul`, whose
prefill tiles take the longer prompts), on every instruction set this CPU runs. (At these
sizes PyTorch's own float GEMM happens to agree too; tests/kernels/test_matmul.py is where the
kernels are told apart from it.)"""

from __future__ import annotations

import pytest
import torch

from specserve import kernels
from specserve.engine.runner import ModelRunner
from specserve.weights.loader import load_model


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("weights, layer_type", [("float32", "Linear"), ("int4", "NativeLinear")])
def test_prompt_logits_are_identical_alone_and_batched(tiny_hf, isa, weights, layer_type,
                                                       monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", isa)
    _, path = tiny_hf
    model = load_model(path, "float32", weights=weights).model
    assert type(model.layers[0].qkv).__name__ == layer_type
    runner = ModelRunner(model, 64, 16)
    blocks = runner.block_manager()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 40, 17, 70)]
    alone = []
    for p in prompts:
        table = blocks.new_table()
        assert blocks.reserve(table, len(p))
        alone.append(runner.forward([p], [0], [table])[0])  # [len(p), vocab]
        blocks.free(table)
    tables = [blocks.new_table() for _ in prompts]
    for table, p in zip(tables, prompts):
        assert blocks.reserve(table, len(p))
    batched = runner.forward(prompts, [0] * len(prompts), tables)
    for a, b in zip(alone, batched):
        assert torch.equal(a, b)
