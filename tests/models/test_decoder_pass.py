"""The fused decoder pass (`decoder_pass` in `specserve/kernels/attention.c`, one native call and
one thread team per pass) against the per-call native path it replaces: the same bits in the
outputs and in every cache entry, for every architecture the native glue runs (biases, per-head
q/k norms), every weight kind it takes (float32 on `f_matmul`, int4 and int8 on `q_matmul`),
every instruction set this CPU runs, and the row counts the engine uses (a decode row, verify
passes of 2..13 rows, prefill chunks, ragged mixes); bad indices are refused before anything is
written."""

from __future__ import annotations

import pytest
import torch

from specserve import kernels
from specserve.models.transformer import Transformer
from specserve.weights.loader import load_model
from tests import tiny
from tests.slots import new_cache


def per_call(monkeypatch) -> None:
    """Switch the fused pass off: every layer's steps as separate native calls."""
    monkeypatch.setattr(Transformer, "_decoder_plan", lambda self: None)


def passes():
    """(rows, starts, slots) of the passes each test runs in turn on one cache: two prompts,
    then verify passes and decode rows of both sequences, alone and mixed."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist()

    out = [([ids(37), ids(5)], [0, 0], [0, 1])]  # prefill chunks, ragged
    pos = [37, 5]
    for n0, n1 in [(1, 0), (0, 1), (2, 1), (13, 9), (1, 1), (5, 3), (33, 0), (7, 12)]:
        rows, starts, slots = [], [], []
        for slot, n in ((0, n0), (1, n1)):
            if n:
                rows.append(ids(n))
                starts.append(pos[slot])
                slots.append(slot)
                pos[slot] += n
        out.append((rows, starts, slots))
    return out


def run(model, cache_dtype) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    cache = new_cache(model, 2, 160, block_size=16, dtype=cache_dtype)
    cache.pool.keys.zero_(), cache.pool.values.zero_()  # entries no pass writes compare equal
    logits = []
    for rows, starts, slots in passes():
        logits += model.forward(cache.batch(rows, starts, slots), cache.pool)
    return logits, cache.pool.keys.clone(), cache.pool.values.clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (unwritten entries, whatever they hold, too)."""
    return torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                       b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32))


@pytest.mark.parametrize("isa", kernels.available_isas())
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("weights", ["float32", "int4", "int8"])
def test_the_fused_pass_gives_the_bits_of_the_per_call_path(tmp_path, monkeypatch, two_threads,
                                                            isa, arch, weights):
    monkeypatch.setenv("SPECSERVE_KERNEL_ISA", isa)
    path = tiny.save_hf_dir(tiny.build_hf_model(arch, seed=1), tmp_path / arch)
    model = load_model(path, "float32", weights=weights, weight_cache=False).model
    assert model._decoder_plan() is not None, "the fused pass runs this model"
    cache_dtype = torch.float16 if weights == "int4" else torch.float32
    fused = run(model, cache_dtype)
    per_call(monkeypatch)
    reference = run(model, cache_dtype)
    assert len(fused[0]) == len(reference[0]) == 15
    for a, b in zip(fused[0], reference[0]):
        assert torch.equal(a, b)
    assert same_bits(fused[1], reference[1]) and same_bits(fused[2], reference[2])


def test_a_row_of_the_fused_pass_has_the_same_bits_alone_and_in_a_batch(tmp_path, two_threads):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=2), tmp_path / "m")
    model = load_model(path, "float32", weights="int4", weight_cache=False).model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist() for n in (9, 40, 1, 13)]
    batched_cache = new_cache(model, 4, 64)
    batched = model.forward(batched_cache.batch(prompts, [0] * 4, [0, 1, 2, 3]),
                            batched_cache.pool)
    for slot, p in enumerate(prompts):
        cache = new_cache(model, 4, 64)
        alone = model.forward(cache.batch([p], [0], [slot]), cache.pool)[0]
        assert torch.equal(alone, batched[slot])


def test_the_fused_pass_refuses_a_bad_block_before_writing(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("qwen2", seed=0), tmp_path / "m")
    model = load_model(path, "float32", weights="int4", weight_cache=False).model
    cache = new_cache(model, 2, 64)
    model.forward(cache.batch([[5, 6, 7]], [0], [0]), cache.pool)
    before = cache.pool.keys.clone(), cache.pool.values.clone()
    batch = cache.batch([[8, 9]], [3], [1])
    batch.block_tables[0, 0] = cache.pool.num_blocks  # one past the last block
    with pytest.raises(ValueError, match="out of range"):
        model.forward(batch, cache.pool)
    assert same_bits(cache.pool.keys, before[0]) and same_bits(cache.pool.values, before[1])


def test_the_plan_follows_projections_replaced_after_construction(tmp_path):
    path = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "m")
    model = load_model(path, "float32", weights="float32", weight_cache=False).model
    first = model._decoder_plan()
    assert first is not None and model._decoder_plan() is first  # built once
    model.layers[1].down = object()  # a projection with no native form
    assert model._decoder_plan() is None


def test_a_projection_the_fused_pass_cannot_run_is_refused(tmp_path):
    from specserve.kernels.decoder import DecoderPlan, Proj

    path = tiny.save_hf_dir(tiny.build_hf_model("llama", seed=0), tmp_path / "m")
    model = load_model(path, "float32", weights="int4", weight_cache=False).model
    projs = [p.native_proj() for l in model.layers for p in (l.qkv, l.o, l.gate_up, l.down)]
    DecoderPlan(kernels.qmatmul(), model.layers, projs)  # as built: accepted
    bad = Proj.from_buffer_copy(projs[0])
    bad.kind = 5  # no such width
    with pytest.raises(ValueError, match="cannot run"):
        DecoderPlan(kernels.qmatmul(), model.layers, [bad] + projs[1:])
