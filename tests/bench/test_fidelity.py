"""The fidelity report (`specserve/bench/fidelity.py`): its comparison in closed form, and on a
real file the int4 path's bound against the file's float32 dequantization by the `gguf`
package, which a re-quantizing repack (the file's values quantized again on the kernel's own
4-bit grid, as the loader once did) breaks."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.bench import fidelity
from specserve.weights.gguf_loader import tensor_bits
from specserve.weights.loader import load_model
from specserve.weights.quant import NativeLinear, layer_projections, projection_width
from tests.conftest import real_model_path

# The default draft (Qwen2.5-Coder 0.5B Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors), 3 prompts ×
# 12 greedy tokens, top-5 of the float32 reference: its own blocks measured 0.035 mean |Δlogp|
# (activation rounding alone), its layers re-quantized as the loader once did 0.101
BOUND = 0.06


def test_compare_in_closed_form():
    ref = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.0]]), -1)
    same = fidelity.compare(ref, ref, k=2)
    assert (same["delta"] == 0).all() and (same["kl"] == 0).all() and same["agree"].all()
    assert same["split"] == 2 and same["margin"] is None
    test = ref.clone()
    test[1] = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.0]), -1)  # swaps ids 1 and 2
    got = fidelity.compare(ref, test, k=2)
    assert got["split"] == 1 and got["margin"] == pytest.approx(1.0)  # logits 2 vs 1
    assert got["delta"][1].tolist() == pytest.approx([1.0, 1.0])  # both top-2 moved by 1 nat
    p = ref[1].exp()
    assert got["kl"][1] == pytest.approx(float((p * (ref[1] - test[1])).sum()))
    summary = fidelity.summarize([got])
    assert summary["mean"] == pytest.approx(0.5) and summary["top1_agree"] == 0.5
    assert summary["values"] == 4 and math.isclose(summary["max"], 1.0, rel_tol=1e-6)


def mean_delta(model, seqs, rows) -> float:
    return fidelity.summarize([fidelity.compare(r, fidelity.forced_rows(model, s))
                               for s, r in zip(seqs, rows)])["mean"]


def test_int4_stays_near_the_files_model_and_a_requantizing_repack_does_not(two_threads):
    """The reference: the file's float32 dequantization (this package's decoder, equal to the
    gguf package's bit for bit: tests/weights/test_dequant.py; the bench uses the gguf
    package's own). The twin: the same int4 model with each layer's projections quantized
    again from those float values on the kernel's grid (4 or 6 bits, as the loader once did)."""
    path = real_model_path("qwen2.5-coder-0.5b")
    ref = load_model(path, weights="float32")
    seqs, rows = [], []
    for kind, chat, text in fidelity.PROMPTS[:3]:
        prompt = fidelity.prompt_ids(ref.tokenizer, chat, text)
        continuation, ref_rows = fidelity.greedy_rows(ref.model, prompt, 12)
        seqs.append(fidelity.Sequence(kind, prompt, continuation))
        rows.append(ref_rows)
    del ref
    own = load_model(path, weights="int4", weight_cache=False)
    assert own.carried == ("the file's own blocks: Q4_K as 4-bit ×12, Q5_0 as 6-bit, f16 scales "
                           "×132, Q6_K as 6-bit, scales per 16 ×12, Q8_0 as 8-bit, f16 scales ×13")
    exact = mean_delta(own.model, seqs, rows)
    bits = tensor_bits(path)
    for i, layer in enumerate(own.model.layers):
        for attr, names in layer_projections(i).items():
            lin = getattr(layer, attr)
            w = torch.cat([p.dequantize() for p in lin.parts])  # the file's values, exactly
            setattr(layer, attr, NativeLinear(w, lin.bias, projection_width("int4", names, bits)))
    again = mean_delta(own.model, seqs, rows)
    assert exact <= BOUND < again, (exact, again)


FUSED = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "gate", "up"))


def test_the_reference_is_the_gguf_packages_model_held_once(tmp_path, monkeypatch):
    """`file_reference` on a tiny llama GGUF (Q8_0; Q/K rows permuted as llama.cpp writes them):
    the same model, bit for bit, as one built from every tensor dequantized first (the dict it
    replaced); and no dequantized tensor outlives its layer (the fused projections are copies:
    the dict held the float32 model one and a half times, 9.7 GB for the 1.5B target)."""
    import weakref

    from gguf import GGMLQuantizationType as T

    from specserve.models.factory import build_model
    from specserve.weights.gguf_loader import config_from_gguf, open_gguf, read_metadata
    from tests import tiny

    hf = tiny.build_hf_model("llama", layers=4, hidden_size=128, intermediate_size=256)
    path, _ = tiny.write_gguf_pair(hf, "llama", {"default": T.Q8_0}, tmp_path / "m.gguf",
                                   tmp_path / "hf")
    made, alive_most = [], [0]
    getitem = fidelity._Dequantized.__getitem__

    def counting(self, name):  # the pieces of fused projections, the model keeps copies
        w = getitem(self, name)
        if name.endswith(FUSED):
            made.append(weakref.ref(w))
        alive_most[0] = max(alive_most[0], sum(r() is not None for r in made))
        return w

    monkeypatch.setattr(fidelity._Dequantized, "__getitem__", counting)
    model, _ = fidelity.file_reference(path)
    held_once = alive_most[0]
    # the dict: every tensor dequantized before the model is built (alive at once), the same
    # values, so the same model
    gguf_file = open_gguf(path)
    cfg = config_from_gguf(gguf_file, read_metadata(gguf_file))
    lazy = fidelity._Dequantized(gguf_file, cfg)
    made.clear()
    alive_most[0] = 0
    eager = build_model(cfg, {name: lazy[name] for name in lazy})
    assert alive_most[0] == 4 * len(FUSED)  # the twin: every layer's pieces held together
    assert held_once <= 3  # q, k, v of one layer (gate, up: 2) at a time
    ids = [5, 17, 33, 8, 90, 41]
    out = []
    for m in (model, eager):
        steps = fidelity._steps(m, ids, None, 4)
        out.append(torch.stack([logp for logp, _ in steps]))
    assert torch.equal(out[0], out[1])
