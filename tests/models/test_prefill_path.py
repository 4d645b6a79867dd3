"""The prefill path (`models/prefill.py`), forced on whatever machine runs this: a prompt row's
result does not depend on the other rows of its pass nor on how its prompt was cut into
chunks; rows off the path keep the native bits; the path is taken, and stays close to the
float model it approximates."""

from __future__ import annotations

import pytest
import torch

from specserve import kernels
from specserve.engine.runner import ModelRunner
from specserve.models.attention import ragged_attention_reference
from specserve.models.prefill import (KV_BLOCK, ONEDNN, PROJECTIONS, DenseProjection,
                                      PrefillChoice, prefill_attention)
from specserve.weights.loader import load_model
from tests import tiny

pytestmark = pytest.mark.skipif(kernels.attention() is None,
                                reason="the prefill path replaces parts of the native pass")


def test_a_dense_projection_row_has_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    proj = DenseProjection(torch.randn(384, 256, generator=g) * 0.05,
                           torch.randn(384, generator=g))
    x = torch.randn(300, 256, generator=g)  # [rows, in]
    whole = proj(x)
    for rows in (1, 2, 3, 15, 16, 17, 64, 100, 250):
        for offset in (0, 7, 50):
            assert torch.equal(proj(x[offset:offset + rows]), whole[offset:offset + rows]), \
                (rows, offset)


def test_a_dense_projection_is_the_bf16_matmul_of_the_float_weights():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 128, generator=g)
    exact = x.double() @ w.double().T + b.double()
    got = DenseProjection(w, b)(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


def _pool(positions: int, kv_heads: int, hd: int, dtype=torch.float16, bs: int = 16):
    g = torch.Generator().manual_seed(2)
    blocks = -(-positions // bs)
    shape = (blocks, kv_heads, bs, hd)
    perm = torch.randperm(blocks, generator=g).to(torch.int32)  # blocks out of order
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype),
            perm)


def test_prefill_attention_gives_a_row_the_same_bits_however_its_prompt_is_chunked():
    heads, kv_heads, hd, n = 4, 2, 16, 2 * KV_BLOCK + 150
    k_pool, v_pool, table = _pool(n, kv_heads, hd)
    q = torch.randn(n, heads, hd, generator=torch.Generator().manual_seed(3))
    whole = prefill_attention(q, k_pool, v_pool, table, 0)
    for cuts in ([0, 1, 300, 511, 512, 513, 1100, n], [0, 700, n], [0, 5, 1030, 1031, n]):
        for lo, hi in zip(cuts, cuts[1:]):
            part = prefill_attention(q[lo:hi], k_pool, v_pool, table, lo)
            assert torch.equal(part, whole[lo:hi]), (lo, hi)


def test_prefill_attention_is_causal_attention_in_bf16():
    heads, kv_heads, hd, n = 6, 2, 32, KV_BLOCK + 90
    k_pool, v_pool, table = _pool(n, kv_heads, hd)
    q = torch.randn(n, heads, hd, generator=torch.Generator().manual_seed(4))
    start = 200  # rows 200.. attend to the keys before them too
    got = prefill_attention(q[start:], k_pool, v_pool, table, start)
    ref = ragged_attention_reference(q[start:], k_pool, v_pool, table[None],
                                     torch.zeros(n - start, dtype=torch.int32),
                                     torch.arange(start, n, dtype=torch.int32))
    err = (got - ref).abs().max()
    assert err < 0.03, err  # bf16 rounding of q, k, v and the block outputs
    assert err > 0  # and it did compute in bf16, not fall back to float32


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def int4_model(request, tmp_path_factory):
    """(int4 model, float32 model) of one tiny checkpoint."""
    path = tiny.save_hf_dir(tiny.build_hf_model(request.param, seed=0),
                            tmp_path_factory.mktemp(request.param))
    return (load_model(path, "float32", weights="int4").model,
            load_model(path, "float32", weights="float32").model)


def _runner(model, choice: PrefillChoice | None) -> ModelRunner:
    runner = ModelRunner(model, 96, 16)
    if choice is not None:
        runner.use_prefill(choice)
    return runner


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 100, (n,), generator=g).tolist() for n in (70, 9, 41)]


def _chunked(runner: ModelRunner, prompt: list[int], cuts: list[int]) -> torch.Tensor:
    """The prompt's last row's logits after feeding it in the chunks `cuts` marks."""
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    assert blocks.reserve(table, len(prompt))
    for lo, hi in zip(cuts, cuts[1:]):
        (logits,) = runner.forward([prompt[lo:hi]], [lo], [table], [1], prefill=[hi - lo])
    blocks.free(table)
    return logits


def test_prompt_rows_give_the_same_bits_alone_batched_and_chunked(int4_model):
    runner = _runner(int4_model[0], ONEDNN)
    prompts = _prompts()
    alone = [_chunked(runner, p, [0, len(p)]) for p in prompts]
    blocks = runner.block_manager(prefix_caching=False)
    tables = [blocks.new_table() for _ in prompts]
    for t, p in zip(tables, prompts):
        assert blocks.reserve(t, len(p))
    batched = runner.forward(prompts, [0] * 3, tables, [1] * 3, prefill=[len(p) for p in prompts])
    for a, b in zip(alone, batched):
        assert torch.equal(a, b)
    assert torch.equal(_chunked(runner, prompts[0], [0, 1, 33, 34, 70]), alone[0])


def _mixed_pass(runner: ModelRunner, a: list[int], b: list[int]) -> torch.Tensor:
    """Sequence `a` computed off the prefill path, then one pass of its next row (a decode
    row) beside `b`'s whole prompt (prompt rows): the decode row's logits."""
    blocks = runner.block_manager(prefix_caching=False)
    ta, tb = blocks.new_table(), blocks.new_table()
    assert blocks.reserve(ta, len(a) + 1) and blocks.reserve(tb, len(b))
    runner.forward([a], [0], [ta], [0], prefill=[0])
    decode, _ = runner.forward([[9], b], [len(a), 0], [ta, tb], [1, 1], prefill=[0, len(b)])
    return decode


def test_a_decode_row_beside_prompt_rows_keeps_its_native_bits(int4_model):
    a, b = _prompts()[:2]
    assert torch.equal(_mixed_pass(_runner(int4_model[0], ONEDNN), a, b),
                       _mixed_pass(_runner(int4_model[0], None), a, b))


def test_an_output_row_recomputed_after_its_prompt_in_one_chunk_is_its_decode_row(int4_model):
    """A chunk after a preemption: prompt rows on the path, then output rows off it (they
    read the prompt's keys stored in the same pass): the bits of the decode row that first
    computed it."""
    runner = _runner(int4_model[0], ONEDNN)
    prompt = _prompts()[0]
    blocks = runner.block_manager(prefix_caching=False)
    table = blocks.new_table()
    assert blocks.reserve(table, len(prompt) + 2)
    runner.forward([prompt], [0], [table], [0], prefill=[len(prompt)])
    decoded = runner.forward([[7, 8]], [len(prompt)], [table], [2], prefill=[0])[0]
    again = runner.forward([prompt + [7, 8]], [0], [table], [2], prefill=[len(prompt)])[0]
    assert torch.equal(again, decoded)


def test_with_nothing_on_onednn_the_split_pass_gives_the_fused_pass_bits(int4_model):
    prompts = _prompts()
    fused = [_chunked(_runner(int4_model[0], None), p, [0, len(p)]) for p in prompts]
    split = _runner(int4_model[0], PrefillChoice((), 10_000))  # takes the split pass, all native
    for p, f in zip(prompts, fused):
        assert torch.equal(_chunked(split, p, [0, len(p)]), f)


@pytest.mark.parametrize("choice", [ONEDNN, PrefillChoice(PROJECTIONS, None),
                                    PrefillChoice((), 0), PrefillChoice(("gate_up",), 30)],
                         ids=lambda c: c.label())
def test_each_part_is_taken_and_stays_close_to_the_float_model(int4_model, choice):
    model, dense = int4_model
    prompt = _prompts()[0]
    native = _chunked(_runner(model, None), prompt, [0, len(prompt)])
    got = _chunked(_runner(model, choice), prompt, [0, len(prompt)])
    ref = _chunked(_runner(dense, None), prompt, [0, len(prompt)])
    assert not torch.equal(got, native)  # the path ran
    assert (got - ref).abs().max() < 2 * max((native - ref).abs().max(), 0.05)
