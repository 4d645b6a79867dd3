"""Accuracy of the quantized formats: the target's perplexity on all the workload text (1,983
tokens: every workload the benchmark ships) with int8 and int4 weights stays within 2% of
the bf16 figure (bf16 holds the GGUF weights as dequantized, rounded to bfloat16)."""

from __future__ import annotations

import pytest

from specserve.bench import workloads
from specserve.bench.quality import perplexity
from specserve.weights.loader import load_model
from tests.conftest import real_model_path


@pytest.fixture(scope="module")
def text() -> str:
    return "\n\n".join(workloads.load(name) for name in workloads.names())


@pytest.fixture(scope="module")
def bf16_figure(text):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = load_model(real_model_path("qwen2.5-coder-1.5b"), "bfloat16", weights="bf16")
        ids = m.tokenizer.encode(text)
        assert len(ids) >= 1800
        return ids, perplexity(m.model, ids)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_perplexity_within_2_percent_of_bf16(weights, bf16_figure, two_threads):
    ids, reference = bf16_figure
    assert 2.0 < reference < 30.0  # a sane figure for code and prose
    m = load_model(real_model_path("qwen2.5-coder-1.5b"), "bfloat16", weights=weights)
    got = perplexity(m.model, ids)
    assert abs(got / reference - 1.0) <= 0.02, (weights, got, reference)


def test_perplexity_of_a_known_toy_distribution():
    """The helper itself: a model whose logits ignore the input gives exp(entropy-like NLL)."""
    import torch

    from specserve.models.transformer import ForwardBatch

    class Uniformish:
        def new_pool(self, num_blocks, block_size):
            return None

        def forward(self, batch: ForwardBatch, cache, last_n=None):
            n = batch.lengths[0]
            logits = torch.zeros(n, 4)
            logits[:, 0] = torch.log(torch.tensor(3.0))  # p = [1/2, 1/6, 1/6, 1/6]
            return [logits]

    ids = [0, 0, 1, 0, 2, 0, 3]  # 6 predicted tokens: three 0s (p=1/2), three others (1/6)
    expected = float(torch.exp(-(3 * torch.log(torch.tensor(0.5)) + 3 * torch.log(torch.tensor(1 / 6))) / 6))
    assert abs(perplexity(Uniformish(), ids, chunk=4) - expected) < 1e-6
